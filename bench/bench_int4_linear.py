"""One AWQ / GPTQ int4 linear on this CPU: dequantized per call (whole) vs per tile of input groups, against
the float weight it stands for, and torch's fused int4 kernel for reference.

A random int4 [out, in] weight (default 22,016 x 2,048: Qwen2.5-VL-3B's fused gate | up projection) in
the method's format, group 128. For each M (decode 1 and 16, prefill 512) and activation dtype, the
median time of `reps` calls of:
- dense: `x @ W` on the float weight in the activation dtype (2 or 4 bytes a weight);
- whole: `Int4Linear.apply`, what the engine runs: the weight dequantized per call in float32
  (cast to the activation dtype), then one matmul;
- tiled: `tile` input features (whole groups) dequantized at a time, each multiplied and summed;
- kernel (bfloat16 only): torch's `_weight_int4pack_mm_for_cpu` on the same weight repacked (its float32
  path is unvectorized), what a fused CPU kernel gives.
glibc keeps freed blocks as the engine makes it (`executor/cpu_malloc.py`). Prints the run and the load
average (a busy machine slows every column), then a markdown table (ms per call).

    python -m bench.bench_int4_linear [--method awq] [--out 22016] [--in 2048] [--batches 1 16 512] [--tile 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from bench.common import describe_run
from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.executor.cpu_malloc import keep_freed_memory
from vlmrun.quantization.int4 import Int4Linear, awq_natural_columns, unpack_int4


def random_int4(method: Int4Linear, out_features: int, in_features: int, gen: torch.Generator) -> dict:
    tensors = {}
    for name, spec in method.param_specs(out_features, in_features).items():
        if name == "g_idx":
            tensors[name] = (torch.arange(in_features) // method.group).to(torch.int32)
        elif spec.dtype == torch.int32:
            tensors[name] = torch.randint(-2**31, 2**31 - 1, spec.shape, generator=gen, dtype=torch.int32)
        else:
            tensors[name] = (torch.rand(spec.shape, generator=gen) * 0.01).to(spec.dtype)
    return tensors


def tiled(method: Int4Linear, tensors: dict, x: torch.Tensor, tile: int) -> torch.Tensor:
    """x @ W, `tile` input features of W dequantized at a time."""
    g, out = method.group, None
    rows_per_feature = 1 if method.name == "awq" else 1 / 8  # qweight rows: AWQ one per input, GPTQ one per 8
    for start in range(0, x.shape[-1], tile):
        part = {"scales": tensors["scales"][start // g:(start + tile) // g],
                "qzeros": tensors["qzeros"][start // g:(start + tile) // g],
                "qweight": tensors["qweight"][int(start * rows_per_feature):int((start + tile) * rows_per_feature)]}
        y = x[:, start:start + tile] @ method.dequantize_stored(part).to(x.dtype)  # the stored column order
        out = y if out is None else out.add_(y)
    return awq_natural_columns(out) if method.name == "awq" else out


def int4pack_kernel(method: Int4Linear, tensors: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's fused CPU int4 GEMM (bfloat16) over the same weight: (q - 8) * s + (8 - z) * s = (q - z) * s."""
    if method.name == "awq":
        q = unpack_int4(tensors["qweight"], 1, method.order)  # [in, out]
        zeros = unpack_int4(tensors["qzeros"], 1, method.order)  # [groups, out]
    else:
        q = unpack_int4(tensors["qweight"], 0)
        zeros = unpack_int4(tensors["qzeros"], 1) + 1  # v1 stores z - 1
    scales = tensors["scales"].float()
    packed = torch._convert_weight_to_int4pack_for_cpu(q.T.contiguous(), 1)
    scales_and_zeros = torch.stack([scales, (8 - zeros) * scales], dim=-1).to(torch.bfloat16)  # [groups, out, 2]
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, method.group, scales_and_zeros)


def median_ms(fns: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["awq", "gptq"], default="awq")
    parser.add_argument("--out", type=int, default=22016)
    parser.add_argument("--in", dest="in_features", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    method = Int4Linear(QuantizationConfig(args.method, group_size=128))
    tensors = random_int4(method, args.out, args.in_features, gen)
    layer = argparse.Namespace(method_params=lambda: tensors)
    kernel = int4pack_kernel(method, tensors)
    print(describe_run("bench.bench_int4_linear"), f"| load average {os.getloadavg()[0]:.1f}")
    print("| dtype | M | dense | int4 whole (engine) | int4 tiled | int4pack kernel |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        dense = method.dequantize(tensors, dtype).t().contiguous()  # [in, out]
        for m in args.batches:
            x = torch.randn(m, args.in_features, generator=gen).to(dtype)
            fns = {"dense": lambda: x @ dense, "whole": lambda: method.apply(layer, x, None),
                   "tiled": lambda: tiled(method, tensors, x, args.tile)}
            if dtype == torch.bfloat16:
                fns["kernel"] = lambda: kernel(x)
                torch.testing.assert_close(kernel(x).float(), (x @ dense).float(), rtol=0.05, atol=0.5)
            torch.testing.assert_close(tiled(method, tensors, x, args.tile).float(), (x @ dense).float(),
                                       rtol=0.05, atol=0.5)
            ms = median_ms(fns, args.reps)
            cells = " | ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in ("dense", "whole", "tiled", "kernel"))
            print(f"| {str(dtype).removeprefix('torch.')} | {m} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
