"""One FP8 block-wise linear on this CPU: dequantized per call vs per tile inside the GEMM, against the
float weights it stands for (bf16 and float32, `F.linear` and oneDNN-packed as the engine runs them).

A random [out, in] weight (default 12,288 x 4,096: Qwen3-8B's gate / up projection), quantized to
Qwen's FP8 format (128 x 128 block scales). For each M (decode sizes 1..32, prefill ~2,000 tokens)
and activation dtype, the median time of `reps` calls of:
- `F.linear` / oneDNN-packed on the float weight in the activation dtype (memory: 2 or 4 bytes a weight);
- FP8 per call: the whole weight dequantized (float32 products, cast), then `F.linear`
  (`Fp8BlockLinear(tile_rows=None)`);
- FP8 tiled: `tile_rows` output rows dequantized at a time, each multiplied into its output slice
  (`Fp8BlockLinear(tile_rows=T)`, the "dequantize" kernel's default T = `vlmrun.quantization.fp8.TILE_ROWS`).
The variants alternate within each round (medians over the rounds). Prints the CPU, torch's threads,
the load average, and a markdown table (ms per call; FP8 weight bytes are 1 a weight).

    python -m bench.bench_fp8_linear [--out 12288] [--in 4096] [--batches 1 8 32 2000] [--tiles 128 512 2048]
                                     [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import add_threads_option, apply_threads, describe_cpu, describe_run
from vlmrun.layers.cpu_kernels import cpu_features
from vlmrun.layers.packed_linear import onednn_linear, pack_weight
from vlmrun.quantization.fp8 import linear_tiled
from vlmrun.quantization.fp8_blocks import dequantize_blocks, quantize_weight


def median_ms(fns: list[Callable[[], torch.Tensor]], reps: int) -> list[float]:
    """Each function's median time (ms) over `reps` rounds, the functions alternating within a round (so a
    load that comes and goes on a shared machine weighs on all of them alike)."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def fp8_per_call(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_blocks(q, scale, x.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=12288)
    parser.add_argument("--in", dest="inp", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 2000])
    parser.add_argument("--tiles", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=10, help="calls per figure at decode sizes (prefill: 3)")
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)

    print(describe_cpu(), "|", cpu_features(), "| load average", os.getloadavg())
    torch.manual_seed(0)
    weight = torch.randn(args.out, args.inp) / args.inp**0.5
    q, scale = quantize_weight(weight)
    print(f"weight [{args.out}, {args.inp}]: FP8 {q.numel() / 2**20:.0f} MiB (+ scales {scale.numel() * 4 / 2**10:.0f} KiB), "
          f"bf16 {q.numel() * 2 / 2**20:.0f} MiB, float32 {q.numel() * 4 / 2**20:.0f} MiB")
    columns = ["F.linear", "oneDNN", "FP8 per call", *[f"FP8 tile {t}" for t in args.tiles]]
    print(f"\n{describe_run('bench.bench_fp8_linear')}\n")
    print("| dtype | M | " + " | ".join(columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        w = weight.to(dtype)
        packed = pack_weight(w)
        for m in args.batches:
            x = torch.randn(m, args.inp).to(dtype)
            reps = args.reps if m <= 64 else 3
            fns = [lambda: F.linear(x, w), lambda: onednn_linear(x, packed), lambda: fp8_per_call(x, q, scale)]
            fns += [lambda t=t: linear_tiled(x, q, scale, None, t) for t in args.tiles]
            figures = median_ms(fns, reps)
            print(f"| {dtype_name} | {m} | " + " | ".join(f"{ms:,.2f}" for ms in figures) + " |", flush=True)


if __name__ == "__main__":
    main()
