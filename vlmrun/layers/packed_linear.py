"""Linear weights packed once for oneDNN: the CPU fast path's GEMMs.

torch's `F.linear` on the CPU multiplies by the weight as it is stored, every call. oneDNN can
reorder a weight once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
inductor's CPU freezing pass does) and then run each GEMM from it (`mkldnn._linear_pointwise`):
on the 2-core AVX-512 bench machine 1.4-1.6x faster than `F.linear` in float32 at decode size
(M = 32) and 1.2x at prefill size (M = 2,496), 1.2x and 1.0x in bfloat16 (bench/bench_cpu_kernels.py).
Float32 results differ from `F.linear` by summation order only (~1e-6 relative).

`pack_linear_weights(model)` swaps the weight of every dense linear (the tensor-parallel linears,
the LM head, `nn.Linear` in the vision tower and routers) for its packed form, in place; a weight
shared with another module (an LM head tied to the embeddings) stays as it is. The layers call
`vlmrun.layers.linear.linear(x, weight, bias)`, which runs oneDNN's kernel for a packed weight and
`F.linear` otherwise.
`linear_backend="torch"` (`EngineConfig`) keeps every weight unpacked: the reference; which weights
"auto" packs on which CPU is `vlmrun/layers/cpu_kernels.py`'s choice.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from vlmrun.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, linear

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def pack_linear_weights(model: nn.Module, min_elements: int = 0) -> int:
    """Packs the weights of the model's dense linears that have at least `min_elements` elements for
    oneDNN (CPU; `cpu_kernels.pack_threshold` says how many); returns how many."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for module in model.modules():
        if not isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            continue
        weight = module.weight
        if weight.is_mkldnn:  # packed already (a runner built again over the same model)
            continue
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            continue
        if weight.numel() < min_elements:  # oneDNN's per-call cost outweighs a small GEMM
            continue
        if uses[id(weight)] > 1:  # tied (e.g. to the embeddings, which read rows of it)
            continue
        with torch.no_grad():
            module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                                         requires_grad=False)
        if type(module) is nn.Linear:  # torch's own forward calls F.linear
            module.forward = _packed_forward.__get__(module)
        packed += 1
    logger.info("linear weights packed for oneDNN: %d", packed)
    return packed


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)
