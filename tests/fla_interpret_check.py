"""The FLA GDN backend against the torch GDN reference on tiny shapes, on the CPU through Triton's
interpreter. Run in a process of its own (tests/test_fla_backend.py does): the interpreter must be
switched on before triton is imported. Every kernel is FLA's own: the varlen conv and chunked delta
rule for extends, the conv update and fused recurrent delta rule for decodes. Prints one line and
exits non-zero on a mismatch (or NaN)."""

from __future__ import annotations

import tests.triton_interpret  # noqa: F401  (first: TRITON_INTERPRET=1 and the shims)

import torch

from tests.test_gdn_pool import CONV_DIM, DK, DV, HK, HV, KERNEL, Stream, make_pool, run_steps
from vlmrun.layers.attention.base import GDNAttention
from vlmrun.layers.attention.fla_backend import FLAGDNBackend
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend

PLAN = [
    [(0, 1, 0, 70), (1, 2, 0, 40)],  # two prefill chunks (one over a 64-token FLA chunk)
    [(0, 1, 70, 1), (1, 2, 40, 30), (2, 4, 0, 5)],  # a one-token chunk among extends
    [(1, 2, 70, 1), (2, 4, 5, 1)],  # a decode step
    [(2, 4, 6, 1), (1, 2, 71, 1), (0, 0, 71, 1)],  # another, with a padding row on the dummy slot 0
]


def run(backend_cls) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    pool = make_pool()
    streams = [Stream(80, 1), Stream(72, 2), Stream(7, 3)]
    layer = GDNAttention(1, HK, HV, DK, DV, KERNEL)
    weight = torch.randn(CONV_DIM, KERNEL, generator=torch.Generator().manual_seed(0)) * 0.5
    plan = [[(streams[i], slot, start, n) for i, slot, start, n in step] for step in PLAN]
    outs = run_steps(backend_cls(pool), layer, weight, plan)
    return {i: outs[id(s)] for i, s in enumerate(streams)}, pool.conv_state.clone(), pool.recurrent_state.clone()


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, infinite when either side holds a NaN or an infinity (a NaN never compares below a bound)."""
    gap = (a - b).abs()
    return float("inf") if not torch.isfinite(gap).all() else gap.max().item()


def main() -> int:
    ref_outs, ref_conv, ref_rec = run(TorchGDNBackend)
    fla_outs, fla_conv, fla_rec = run(FLAGDNBackend)
    worst = max(max_gap(a, b) for i in ref_outs for a, b in zip(ref_outs[i], fla_outs[i], strict=True))
    live = [1, 2, 4]  # the dummy slot 0 took a padding row: compare the live slots
    conv_err = max_gap(ref_conv[:, live], fla_conv[:, live])
    rec_err = max_gap(ref_rec[:, live], fla_rec[:, live])
    print(f"outputs max|fla - torch| = {worst:.2e}; conv state {conv_err:.2e}; recurrent state {rec_err:.2e}")
    return 0 if max(worst, conv_err, rec_err) < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
