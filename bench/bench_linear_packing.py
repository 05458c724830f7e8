"""F.linear against oneDNN-packed weights (vlmrun/layers/packed_linear.py) at the bench model's shapes.

Decode (M = 32 rows) and prefill (M = 2,496 rows: 32 prompts of one 224x224 image) sizes of the
qkv, gate_up and down projections of bench_cpu_vs_hf.py's checkpoint (text hidden 512), float32 and
bfloat16: milliseconds per call (mean of 50 after 3 warm-ups) and the largest relative difference.

    python bench/bench_linear_packing.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmrun.layers.linear import linear  # noqa: E402

SHAPES = {"qkv": (1024, 512), "gate_up": (3072, 512), "down": (512, 1536)}  # (out, in)


def per_call_ms(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    print(f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for name, (out_features, in_features) in SHAPES.items():
                weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                for rows in (32, 2496):
                    x = torch.randn(rows, in_features, generator=gen).to(dtype)
                    plain, fast = per_call_ms(lambda: F.linear(x, weight)), per_call_ms(lambda: linear(x, packed))
                    ref = F.linear(x.float(), weight.float())
                    rel = ((linear(x, packed).float() - ref).abs().max() / ref.abs().max()).item()
                    print(f"{str(dtype)[6:]:8s} {name:8s} M={rows:5d}: F.linear {plain:8.3f} ms, packed {fast:8.3f} ms, "
                          f"{plain / fast:4.2f}x, max rel diff {rel:.1e}")


if __name__ == "__main__":
    main()
