"""A step's sampling batch: rebuilt from the rows (`SamplingBatch.build`) vs gathered from the runner's
persistent per-row state (`SamplingState.gather` + `record`), milliseconds per step.

--batch requests, each with a prompt of --history tokens, decode --steps steps (one output appended per
step, outside the timing). Two mixes: `plain` (greedy and sampled rows with temperature / top-k / top-p /
logprobs, no penalties) and `penalties` (every row with repetition, frequency and presence penalties).
The state's first step writes every row (the admission); the figure is the median over the later
steps. On the CPU the tensor work runs on the host too: a small --vocab shows the host (Python) part,
a real one (151936, Qwen's) adds the `[batch, vocab]` tensor work both pay.

    python -m bench.bench_sampling_state --batch 256 --history 2000 --vocab 1024
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.layers.sampling_state import SamplingState
from vlmrun.sampling_params import SamplingParams


def make_rows(mix: str, batch: int, history: int, vocab: int, rng: random.Random) -> list[SamplingRow]:
    if mix == "penalties":
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, repetition_penalty=1.2, frequency_penalty=0.3,
                                 presence_penalty=0.2) for i in range(batch)]
    else:
        params = [SamplingParams(temperature=0.0) if i % 3 == 0 else
                  SamplingParams(temperature=0.8, top_k=50, top_p=0.9, logprobs=1 if i % 5 == 0 else None)
                  for i in range(batch)]
    return [SamplingRow(p, [rng.randrange(vocab) for _ in range(history)], [], None, [0]) for p in params]


def time_steps(mix: str, how: str, args: argparse.Namespace) -> float:
    """Median milliseconds per step after the first."""
    rng = random.Random(0)
    rows = make_rows(mix, args.batch, args.history, args.vocab, rng)
    state = SamplingState(args.batch + 1, "cpu")
    page_rows = list(range(args.batch))
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch,))
        start = time.perf_counter()
        if how == "build":
            SamplingBatch.build(rows, args.vocab)
        else:
            state.record(state.gather(page_rows, rows, args.vocab), tokens)
        times.append(time.perf_counter() - start)
        for row, token in zip(rows, tokens.tolist()):
            row.output_token_ids.append(token)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--history", type=int, default=2000, help="prompt tokens of each request")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, history {args.history}, vocab {args.vocab}: ms per step (median of {args.steps - 1})")
    for mix in ("plain", "penalties"):
        build, gather = time_steps(mix, "build", args), time_steps(mix, "gather", args)
        print(f"{mix:10s} build {build:8.3f}   state {gather:8.3f}   ({build / gather:.1f}x)")


if __name__ == "__main__":
    main()
