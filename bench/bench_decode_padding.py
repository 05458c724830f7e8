"""vlmrun's decode with and without padding to batch-size buckets, on the CPU, in one process.

Two engines over bench_cpu_vs_hf.py's random-weight Qwen3-VL checkpoint, `enforce_eager=True`
(unpadded) and `enforce_eager=False` (padded, as CUDA graphs need), prefix caching off, run
alternately on the same fresh request sets; prints requests/s per workload (median of the repeats
after the first) and padded / eager.

    python bench/bench_decode_padding.py --requests 32 --max-tokens 32 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_cpu_vs_hf as peer  # noqa: E402
from vlmrun import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed", "text"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = peer.build_checkpoint(Path(tmp))
        engines = {eager: LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=eager,
                              enable_prefix_caching=False) for eager in (True, False)}
        for workload in args.workloads:
            rates: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.repeats):
                for eager in ((True, False) if rep % 2 == 0 else (False, True)):
                    images, prompts, lengths = peer.make_requests(args.requests, workload, 1000 + rep, args.max_tokens)
                    requests = [p if img is None else {"prompt": p, "images": [img]} for img, p in zip(images, prompts)]
                    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
                    start = time.perf_counter()
                    engines[eager].generate(requests, params, use_tqdm=False)
                    rates[eager].append(args.requests / (time.perf_counter() - start))
            eager, padded = (statistics.median(rates[e][1:]) for e in (True, False))
            print(f"{workload}: eager {eager:.2f} req/s, padded {padded:.2f} req/s, padded / eager {padded / eager:.3f} "
                  f"(runs: eager {[round(r, 2) for r in rates[True]]}, padded {[round(r, 2) for r in rates[False]]})",
                  flush=True)


if __name__ == "__main__":
    main()
