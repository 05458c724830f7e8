"""AWQ and GPTQ 4-bit weights: the `Int4Linear` linear method (`vlmrun.layers.linear_method`).

Both formats store a weight W [out, in] as 4-bit integers q, eight to an int32, with one float16
scale s and one 4-bit zero point z per group of `group_size` input features and output feature:
W[o, i] = (q[o, i] - z[i // group, o]) * s[i // group, o]. They differ in the packing:

- AWQ (AutoAWQ's GEMM version): `qweight` int32 [in, out / 8], packed along the output features;
  nibble k (bits 4k..4k+3) of element j holds output feature 8j + AWQ_ORDER[k]. `qzeros` int32
  [in / group, out / 8], packed the same way; `scales` float16 [in / group, out].
- GPTQ (the v1 "gptq" checkpoint format, no activation order): `qweight` int32 [in / 8, out], packed
  along the input features in order (nibble k of element r: input feature 8r + k); `qzeros` int32
  [in / group, out / 8], packed along the output features in order, storing z - 1; `scales` float16
  [in / group, out]; `g_idx` int32 [in], which must be i // group (checked at load: a checkpoint
  quantized in activation order permutes it, and is refused).

The packed tensors declare their packing (`ParamSpec` out_pack / in_pack), so the one loader cuts
tensor-parallel shards, fused parts and MoE experts of them as of any weight; a row-parallel shard
must hold whole groups (the layer checks it when the method is assigned, naming itself and the TP
size). A width the format cannot store (output features not a multiple of 8, input features not a
multiple of the group size) is an error when the layer is built.

On every device the method dequantizes the weight in float32 per call and multiplies in the
activation dtype (`apply`): the weight stays 4-bit in memory between calls.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.layers.linear_method import LinearMethod, ParamSpec
from vlmrun.loader import materialize
from vlmrun.quantization.finite import check_scales

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble k of a packed element holds feature AWQ_ORDER[k] of its eight
SEQUENTIAL_ORDER = tuple(range(PACK))


def _nibble_shifts(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[8] int32: the bit offset of feature f's nibble (4k for the k with order[k] == f), made on `device`
    by arithmetic, not copied from the host (a copy cannot be captured in a CUDA graph)."""
    feature = torch.arange(PACK, dtype=torch.int32, device=device)
    if order == SEQUENTIAL_ORDER:
        return feature * 4
    if order == AWQ_ORDER:  # even features in nibbles 0..3, odd ones in 4..7
        return (feature // 2 + feature % 2 * 4) * 4
    raise ValueError(f"nibble order {order} is neither AWQ's {AWQ_ORDER} nor sequential")


def nibble_planes(packed: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """int32 [rows, n] -> its 4-bit values as int32 [rows, 8, n]: plane f holds feature f of each element's
    eight (the nibble k with order[k] == f). Planes keep the long dim innermost, so each shift runs vectorized."""
    shifts = _nibble_shifts(order, packed.device)
    return (packed[:, None, :] >> shifts[None, :, None]).bitwise_and_(0xF)


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """int32 [rows, n] -> its 4-bit values (int32), eight features per element along `dim` (0 or 1):
    [8 rows, n] or [rows, 8 n], feature 8j + f from nibble k of element j where order[k] == f."""
    planes = nibble_planes(packed, order)  # [rows, 8, n]
    return planes.flatten(0, 1) if dim == 0 else planes.transpose(1, 2).flatten(1, 2)


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """2-D 4-bit `values` (0..15) -> int32, eight features per element along `dim` (the inverse of `unpack_int4`)."""
    if values.shape[dim] % PACK:
        raise ValueError(f"{values.shape[dim]} features cannot be packed {PACK} to an int32")
    if int(values.min()) < 0 or int(values.max()) > 15:
        raise ValueError("4-bit values must lie in [0, 15]")
    values = values.to(torch.int64)
    planes = values.unflatten(0, (-1, PACK)) if dim == 0 else values.unflatten(1, (-1, PACK)).transpose(1, 2)
    shifts = _nibble_shifts(order, values.device).to(torch.int64)
    words = (planes << shifts[None, :, None]).sum(1)  # [rows, n] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


class Int4Linear(LinearMethod):
    """AWQ (`config.method == "awq"`) or GPTQ ("gptq") 4-bit weights with per-group scales and zero points."""

    quantized = True

    def __init__(self, config: QuantizationConfig):
        if config.method not in ("awq", "gptq"):
            raise ValueError(f"Int4Linear reads awq or gptq weights, not {config.method!r}")
        if config.bits != 4:
            raise ValueError(f"{config.method} with bits={config.bits} is not supported (supported: 4)")
        if config.group_size <= 0 or config.group_size % PACK:
            raise ValueError(f"{config.method} group_size={config.group_size} is not supported "
                             f"(supported: a positive multiple of {PACK}, e.g. 128)")
        self.name = config.method
        self.group = config.group_size
        self.order = AWQ_ORDER if config.method == "awq" else SEQUENTIAL_ORDER

    # ------------------------------------------------------------------ storage

    def param_specs(self, out_features: int, in_features: int) -> dict[str, ParamSpec]:
        self._check_widths(out_features, in_features)
        groups, g = in_features // self.group, self.group
        specs = {
            "qzeros": ParamSpec((groups, out_features // PACK), torch.int32, out_dim=1, in_dim=0,
                                out_pack=PACK, in_pack=g),
            "scales": ParamSpec((groups, out_features), torch.float16, out_dim=1, in_dim=0, in_pack=g),
        }
        if self.name == "awq":
            specs["qweight"] = ParamSpec((in_features, out_features // PACK), torch.int32, out_dim=1, in_dim=0,
                                         out_pack=PACK)
        else:
            specs["qweight"] = ParamSpec((in_features // PACK, out_features), torch.int32, out_dim=1, in_dim=0,
                                         in_pack=PACK)
            specs["g_idx"] = ParamSpec((in_features,), torch.int32, out_dim=None, in_dim=0)
        return specs

    def _check_widths(self, out_features: int, in_features: int) -> None:
        if out_features % PACK:
            raise ValueError(f"{self.name} int4 stores output features {PACK} to an int32; this layer has "
                             f"{out_features}, not a multiple of {PACK}")
        if in_features % self.group:
            raise ValueError(f"{self.name} int4 with group_size={self.group} needs whole groups of input "
                             f"features; this layer has {in_features}, not a multiple of {self.group}")

    def checkpoint_tensor(self, name: str, tensor: Any, out_features: int) -> Any:
        if name == "scales":  # small (a value per group and output feature): read here, NaN / inf refused
            return check_scales(materialize(tensor), name, tensor)
        if name == "g_idx":
            tensor = materialize(tensor)
            expected = torch.arange(tensor.shape[-1], device=tensor.device) // self.group
            if tensor.dim() != 1 or not torch.equal(tensor.to(torch.int64), expected):
                raise ValueError(f"gptq g_idx is not input feature // group_size ({self.group}): the checkpoint was "
                                 f"quantized in activation order (desc_act) or with another group layout, which "
                                 f"is not supported")
        return tensor

    def regroup_output(self, name: str, tensor: torch.Tensor,
                       regroup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Output features reordered by `regroup` (of an [out, ..] tensor's rows): scales and GPTQ's qweight
        by their columns, a tensor packed along the outputs unpacked, reordered and packed again."""
        if name == "g_idx":  # runs along the inputs
            return tensor
        if name == "qzeros" or (name == "qweight" and self.name == "awq"):  # [rows, out / 8]
            return pack_int4(regroup(unpack_int4(tensor, 1, self.order).T).T, 1, self.order)
        return regroup(tensor.T).T.contiguous()  # scales, GPTQ's qweight: [rows, out]

    # ------------------------------------------------------------------ compute

    def dequantize(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype` (a transposed view of the [in, out] weight)."""
        weight = self.dequantize_stored(params)  # [in, out]
        if self.name == "awq":
            weight = awq_natural_columns(weight)
        return weight.to(dtype).t()

    def dequantize_stored(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weight as [in, out] float32, (q - z) * s per group of input features, its columns in the order
        the packing keeps them: GPTQ's in order, AWQ's plane by plane (column f * out / 8 + j is output
        feature 8j + f: `awq_natural_columns` puts them in order)."""
        scales = params["scales"].float()  # [groups, out]
        groups, out = scales.shape
        if self.name == "awq":
            q = nibble_planes(params["qweight"], self.order)  # [in, 8, out / 8]
            zeros = nibble_planes(params["qzeros"], self.order).view(groups, 1, out)  # planes, as q
            scales = scales.view(groups, -1, PACK).transpose(1, 2)  # [groups, 8, out / 8]: planes, as q
        else:
            q = nibble_planes(params["qweight"])  # [in / 8, 8, out]: input features 8r + f, in order
            zeros = (unpack_int4(params["qzeros"], dim=1) + 1).view(groups, 1, out)  # v1 stores z - 1
        scales = scales.reshape(groups, 1, out)
        weight = q.view(groups, -1, out).float()  # [groups, group, out]
        offsets = (zeros * scales).neg_()  # -z * s: exact, as is q * s, so the sum is exactly (q - z) * s
        return torch.addcmul(offsets, weight, scales, out=weight).view(-1, out)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [.., in] -> [.., out]: the weight dequantized for this call (it stays 4-bit between calls)."""
        y = x @ self.dequantize_stored(layer.method_params()).to(x.dtype)  # [.., out], the stored column order
        if self.name == "awq":
            y = awq_natural_columns(y)
        return y if bias is None else y + bias


def awq_natural_columns(y: torch.Tensor) -> torch.Tensor:
    """[.., out] with AWQ's plane-major columns (f * out / 8 + j) -> output features in order (8j + f)."""
    return y.unflatten(-1, (PACK, -1)).transpose(-1, -2).flatten(-2)
