"""vlmrun's decode with and without padding to batch-size buckets, on the CPU, in one process.

Two engines over the CPU bench's random-weight Qwen3-VL checkpoint (bench/common.py), `enforce_eager=True`
(unpadded) and `enforce_eager=False` (padded, as CUDA graphs need), prefix caching off, run
alternately on the same fresh request sets; prints requests/s per workload (median of the repeats
after the first) and padded / eager.

    python -m bench.bench_decode_padding --requests 32 --max-tokens 32 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import WORKLOADS, build_checkpoint, generate_timed, make_requests
from vlmrun import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=WORKLOADS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        engines = {eager: LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=eager,
                              enable_prefix_caching=False) for eager in (True, False)}
        for workload in args.workloads:
            rates: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.repeats):
                for eager in ((True, False) if rep % 2 == 0 else (False, True)):
                    requests = make_requests(args.requests, workload, 1000 + rep, args.max_tokens)
                    seconds, _ = generate_timed(engines[eager], *requests)
                    rates[eager].append(args.requests / seconds)
            eager, padded = (statistics.median(rates[e][1:]) for e in (True, False))
            print(f"{workload}: eager {eager:.2f} req/s, padded {padded:.2f} req/s, padded / eager {padded / eager:.3f} "
                  f"(runs: eager {[round(r, 2) for r in rates[True]]}, padded {[round(r, 2) for r in rates[False]]})",
                  flush=True)


if __name__ == "__main__":
    main()
