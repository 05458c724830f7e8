"""The GEMM floor of bench_cpu_vs_hf.py's workloads: the most requests/s this CPU allows any engine.

Every engine runs the same dense model on the same requests, so every one multiplies the same
matrices: vision tower, mergers, text layers (prompt and output tokens), LM head. This script
counts those FLOPs for the workloads of `bench.bench_cpu_vs_hf` (its checkpoint, the requests of
one of its timed runs, prompt lengths as the checkpoint's processor makes them, no padding counted),
times every GEMM shape the count contains on this machine at its best (`F.linear` and oneDNN-packed
weights, the faster one, best of several rounds; the counting and timing are `bench/gemm_ceiling.py`),
and prints:

- GFLOP per batch by part (linears by where they run, attention's QK and PV products);
- the GEMM floor: the seconds the batch takes if every linear ran at the best rate measured for its
  shape and nothing else took any time (attention, norms, rotary, sampling, host work all free);
- the ceiling it implies, requests/s.

`python -m bench.bench_cpu_vs_hf --ceiling` prints the same ceiling beside the rates it measures,
with each side's share of it and the issue's aims (2x HF, 1.5x vLLM) as shares of it.
A rate above the ceiling cannot be reached on this machine by any engine that runs the model's FLOPs.

    python -m bench.roofline_cpu --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import DTYPES, WORKLOADS, build_checkpoint, describe_cpu, hide_flash_linear_attention
from bench.gemm_ceiling import ceiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES)
    parser.add_argument("--seed", type=int, default=1001, help="the requests of bench_cpu_vs_hf.py's first timed run")
    parser.add_argument("--rounds", type=int, default=5, help="timings per GEMM shape; the best one counts")
    args = parser.parse_args()
    hide_flash_linear_attention()
    from transformers import AutoModelForImageTextToText, AutoProcessor

    print(f"device: {describe_cpu()}; bench_cpu_vs_hf.py's checkpoint, {args.requests} requests, seed {args.seed}")
    cache: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        processor = AutoProcessor.from_pretrained(model_dir)
        for dtype_name in args.dtypes:
            for workload in args.workloads:
                result = ceiling(model, processor, workload, getattr(torch, dtype_name), args.requests,
                                 args.max_tokens, args.seed, args.rounds, cache)
                print(f"{dtype_name} {workload}: {result.describe()}", flush=True)


if __name__ == "__main__":
    main()
