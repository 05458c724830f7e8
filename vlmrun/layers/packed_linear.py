"""Linear weights packed once for oneDNN: the CPU fast path's GEMMs.

torch's `F.linear` on the CPU multiplies by the weight as it is stored, every call. oneDNN can
reorder a weight once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
inductor's CPU freezing pass does) and then run each GEMM from it (`mkldnn._linear_pointwise`):
on the 2-core AVX-512 bench machine 1.4-1.6x faster than `F.linear` in float32 at decode size
(M = 32) and 1.2x at prefill size (M = 2,496), 1.2x and 1.0x in bfloat16 (bench/bench_cpu_kernels.py).
Float32 results differ from `F.linear` by summation order only (~1e-6 relative).

`OneDNNPackedLinear` is the linear method (`vlmrun.layers.linear_method`) of a packed layer.
`pack_linear_weights(model)` moves every unquantized dense linear (the tensor-parallel and
replicated linears, so the vision tower and routers too, and the LM head) to it, packing its
weight in place; a weight shared with another module (an LM head tied to the embeddings) stays as
it is, and so does a quantized layer (its method multiplies its own way).
`linear_backend="torch"` (`EngineConfig`) keeps every weight unpacked: the reference; which weights
"auto" packs on which CPU is `vlmrun/layers/cpu_kernels.py`'s choice.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import torch
from torch import nn

from vlmrun.layers.linear import LinearBase, ParallelLMHead
from vlmrun.layers.linear_method import LinearMethod

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [.., in] -> [.., out] through oneDNN's GEMM, from a weight packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] CPU weight reordered into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class OneDNNPackedLinear(LinearMethod):
    """The unquantized weight, packed once for oneDNN (`after_loading`); each call runs oneDNN's GEMM."""

    name = "onednn"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return onednn_linear(x, layer.weight, bias)

    def after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            layer.weight = nn.Parameter(pack_weight(layer.weight), requires_grad=False)


ONEDNN = OneDNNPackedLinear()


def pack_linear_weights(model: nn.Module, min_elements: int = 0) -> int:
    """Packs the weights of the model's unquantized dense linears that have at least `min_elements`
    elements for oneDNN (CPU; `cpu_kernels.pack_threshold` says how many); returns how many."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)) or module.method.name != "unquantized":
            continue  # packed already (a runner built again over the same model), or quantized
        weight = module.weight
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            continue
        if weight.numel() < min_elements:  # oneDNN's per-call cost outweighs a small GEMM
            continue
        if uses[id(weight)] > 1:  # tied (e.g. to the embeddings, which read rows of it)
            continue
        module.method = ONEDNN
        ONEDNN.after_loading(module)
        packed += 1
    logger.info("linear weights packed for oneDNN: %d", packed)
    return packed
