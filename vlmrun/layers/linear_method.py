"""The linear-method seam: how one linear layer stores its weight and multiplies by it.

A linear layer (`vlmrun.layers.linear.LinearBase`: column-, row-parallel, replicated, and the MoE
experts' fused projections) owns no weight format of its own. Its `LinearMethod` says
- `param_specs(out_features, in_features)`: the tensors that stand for an [out, in] weight, each a
  `ParamSpec` (shape, dtype, and which of its dims run along the output and input features, and how
  many features one stored element covers: the packing), so the layer can register them and cut a
  tensor-parallel shard of each from the full checkpoint tensor;
- `checkpoint_tensor(name, tensor, out_features)`: a checkpoint tensor put in the layout the
  parameter keeps, before it is sharded (FP8 block scales become one row per output feature);
- `dequantize(params, dtype)`: the [out, in] weight in `dtype` (the reference of every method);
- `regroup_output(name, tensor, regroup)`: a checkpoint tensor with its output features reordered
  (a model whose checkpoint orders a fused layer's rows otherwise);
- `apply(layer, x, bias)`: x [.., in] -> [.., out] (the layer's tensors by `layer.method_params()`);
- `after_loading(layer)`: a last rearrangement once every tensor arrived (oneDNN packing, scale
  compaction).

The method is chosen once per layer when the model is built (`vlmrun.quantization.assign`): from the
checkpoint's `quantization_config`, the user's `quantization`, and the device; `UNQUANTIZED` by default.
The methods: `UnquantizedLinear` (here, `F.linear`), `OneDNNPackedLinear` (`layers/packed_linear.py`,
the CPU fast path), `Fp8BlockLinear` (`quantization/fp8.py`), `Int4Linear` (AWQ / GPTQ,
`quantization/int4.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ParamSpec:
    """One stored tensor of a linear weight.

    `dtype` None: the model's dtype (a float weight, a bias); otherwise kept as is (float8, int32,
    float16 scales). `out_dim` / `in_dim`: the dim that runs along the output / input features (None:
    it does not), `out_pack` / `in_pack`: features per stored element along it (8 for int4 packed in
    int32, the group size for per-group scales, 128 for FP8 block scales); a partial last element
    covers the features left (ceil)."""

    shape: tuple[int, ...]
    dtype: Optional[torch.dtype] = None
    out_dim: Optional[int] = 0
    in_dim: Optional[int] = 1
    out_pack: int = 1
    in_pack: int = 1

    def size_along(self, dim: Optional[int]) -> int:
        return 1 if dim is None else self.shape[dim]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class LinearMethod:
    """The unquantized method's behaviour is the default of every hook; a method overrides what differs."""

    name = "unquantized"
    quantized = False  # whether the weight is stored in fewer bits than the model's dtype

    def param_specs(self, out_features: int, in_features: int) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((out_features, in_features))}

    def checkpoint_tensor(self, name: str, tensor: Any, out_features: int) -> Any:
        """The checkpoint's `name` tensor (all `out_features` rows of it) in the layout the parameter keeps."""
        return tensor

    def dequantize(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight from this method's tensors (the layer's, or one expert's slices)."""
        return params["weight"]

    def regroup_output(self, name: str, tensor: torch.Tensor,
                       regroup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The checkpoint's `name` tensor (all its output features, as `checkpoint_tensor` left it) with the
        output features reordered by `regroup`, which reorders the rows of an [out, ..] tensor (a checkpoint
        that groups a fused layer's rows otherwise: Qwen3-Next's GDN projections). Here dim 0 runs along
        the output features, one a row (a float weight; FP8 scales, expanded to rows)."""
        return regroup(tensor)

    def apply(self, layer: "nn.Module", x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [.., in] -> [.., out]."""
        return F.linear(x, self.dequantize(layer.method_params(), x.dtype), bias)

    def after_loading(self, layer: "nn.Module") -> None:
        """Called once every tensor of `layer` is loaded."""

    def __repr__(self) -> str:
        return self.name


class UnquantizedLinear(LinearMethod):
    """The weight as loaded, in the model's dtype: `F.linear`."""

    def apply(self, layer: "nn.Module", x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)  # the hot path: no tensor dict built per call


UNQUANTIZED = UnquantizedLinear()
