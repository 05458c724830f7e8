"""n-gram drafting's host time per request per step: the backward scan against the kept index.

One simulated request per case: a prompt of --prompt-lengths tokens, then --steps decode steps, each
appending 1 to 4 tokens (an accepted run) and asking for 3 drafts with the tokens as the scheduler
passes them (prompt + output, concatenated each step), once without a key (`NgramProposer._scan`, one
backward scan) and once with the request's key (`NgramIndex`, extended by the appended tokens). The
drafts must agree. Three contents: `random` (vocab 150k: no earlier occurrence, the scan's worst case),
`repeating` (a 50-token block repeated: the scan stops at the first full match, its best case) and
`zipf` (tokens drawn from a Zipf law over 5k ids: text-like, many short partial matches).
Microseconds per propose, median of --rounds.

    python -m bench.bench_ngram --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Optional

from vlmrun.spec_decode.ngram import NgramProposer


def make_tokens(kind: str, length: int, rng: random.Random) -> list[int]:
    if kind == "random":
        return [rng.randrange(150_000) for _ in range(length)]
    if kind == "repeating":
        block = [rng.randrange(150_000) for _ in range(50)]
        return (block * (length // 50 + 1))[:length]
    weights = [1 / (i + 1) for i in range(5000)]
    return rng.choices(range(5000), weights=weights, k=length)


def run(kind: str, prompt_len: int, steps: int, key: Optional[str], seed: int,
        min_n: int, max_n: int) -> tuple[float, list[list[int]]]:
    """Seconds per propose over `steps` steps of one request, and its drafts."""
    rng = random.Random(seed)
    prompt = make_tokens(kind, prompt_len, rng)
    continuation = make_tokens(kind, prompt_len + 4 * steps, random.Random(seed + 1))
    proposer = NgramProposer(3, min_n, max_n)
    output: list[int] = []
    drafts, spent = [], 0.0
    for _ in range(steps):
        take = rng.randrange(1, 5)
        output += continuation[len(output):len(output) + take]
        start = time.perf_counter()
        drafts.append(proposer.propose(prompt + output, 3, key=key))  # as the scheduler calls it
        spent += time.perf_counter() - start
    return spent / steps, drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=3)
    args = parser.parse_args()
    print(f"prompt_lookup_min {args.min_n}, max {args.max_n}, 3 drafts; us per propose (median of {args.rounds})")
    print("| content | prompt | scan | kept index | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for kind in ("random", "repeating", "zipf"):
        for length in args.prompt_lengths:
            times: dict[str, list[float]] = {"scan": [], "index": []}
            for r in range(args.rounds):
                scan, want = run(kind, length, args.steps, None, r, args.min_n, args.max_n)
                index, got = run(kind, length, args.steps, "request", r, args.min_n, args.max_n)
                assert got == want, f"{kind} {length}: the index's drafts differ from the scan's"
                times["scan"].append(scan)
                times["index"].append(index)
            scan, index = (statistics.median(times[s]) * 1e6 for s in ("scan", "index"))
            print(f"| {kind} | {length} | {scan:.1f} | {index:.1f} | {scan / index:.1f}x |")


if __name__ == "__main__":
    main()
