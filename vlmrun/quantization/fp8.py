"""FP8 block-wise linear methods: Qwen's `-FP8` checkpoints, and online FP8 of a float checkpoint.

`Fp8BlockLinear` keeps a layer's weight as the checkpoint stores it: `weight` float8_e4m3fn [out, in]
and `weight_scale_inv` float32, one scale per 128 x 128 block (`vlmrun.quantization.fp8_blocks`). So
that tensor-parallel slicing, fused parts (q | k | v) and Qwen3-Next's row regrouping handle the
scales as they handle the weight, `checkpoint_tensor` expands the checkpoint's block rows to one
scale row per output row; once loaded, `after_loading` compacts them back to the largest row group
the rows allow (128 rows a scale at full shapes), so the scales stay a fraction of a percent of the
weight. Only the input columns stay blocked: a shard must start on a 128-column block boundary
(`LinearBase` checks it, naming the layer and the TP size).

Multiplying (`fp8_kernel`, an `EngineConfig` field):
- "dequantize" (default, any device): the weight stays FP8 in memory and is dequantized at each
  call (float32 products as transformers', then the activation dtype; the FP8 values read through
  float16, `fp8_blocks.fp8_to_float32`, as torch's own conversion is slow on the CPU). On the CPU in
  tiles of `TILE_ROWS` output rows into reused scratch, each multiplied into its slice of the output
  while in cache (bench/bench_fp8_linear.py against the whole weight per call: BENCHMARKS.md, "FP8
  weights on the CPU"); on other devices the whole weight per call. The MoE experts dequantize one
  expert's weights at a time, whichever the kernel.
- "cuda" (opt-in, CUDA only): activations quantized per token and 128 columns, then torch's
  block-scaled FP8 GEMM (`torch.nn.functional.scaled_mm`, 1x128 x 128x128 scales: cuBLAS on Hopper);
  not yet checked on a GPU against "dequantize", hence opt-in. FlashInfer's `gemm_fp8_nt_groupwise`
  is Blackwell-only, so it is not used.

Online FP8 (`QuantizationConfig.online`): `Fp8OnlineLinear` loads the float weight, then quantizes it
per 128 x 128 block after loading, each fused part (q | k | v, gate | up) on its own as a converted
checkpoint has it, and moves the layer (a linear or the fused experts) to `Fp8BlockLinear`. It is
this rank's shard that is quantized: under tensor parallelism the blocks start at the shard's rows.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.layers.linear import LinearBase
from vlmrun.layers.linear_method import LinearMethod, ParamSpec, ceil_div
from vlmrun.layers.moe import PROJECTIONS, FusedExperts, expert_param_name
from vlmrun.loader import materialize
from vlmrun.quantization.finite import check_scales
from vlmrun.quantization.fp8_blocks import (BLOCK, FP8, compact_rows, dequantize_blocks, expand_rows, fp8_to_float32,
                                            multiply_by_scales, quantize_activation, quantize_weight, row_group)

FP8_KERNELS = ("dequantize", "cuda")
TILE_ROWS = 512  # output rows the "dequantize" kernel dequantizes at once on the CPU (BENCHMARKS.md)
SCALE = "weight_scale_inv"

Layer = Union[LinearBase, FusedExperts]


def make_fp8_method(config: QuantizationConfig, device: torch.device, fp8_kernel: str = "dequantize") -> LinearMethod:
    """The method of the layers `config` quantizes, multiplying with `fp8_kernel` on `device`."""
    if fp8_kernel not in FP8_KERNELS:
        raise ValueError(f"fp8_kernel={fp8_kernel!r} is not one of {', '.join(FP8_KERNELS)}")
    if fp8_kernel == "cuda" and torch.device(device).type != "cuda":
        raise ValueError(f"fp8_kernel='cuda' runs FP8 GEMMs on a CUDA device; this engine runs on {device} "
                         f"(use fp8_kernel='dequantize')")
    if fp8_kernel == "cuda":
        block: Fp8BlockLinear = Fp8CudaLinear()
    else:  # tiles measured on the CPU; elsewhere (CUDA, unmeasured) the whole weight per call, fewer launches
        block = Fp8BlockLinear(TILE_ROWS if torch.device(device).type == "cpu" else None)
    return Fp8OnlineLinear(block) if config.online else block


def weight_and_scale_names(layer: Layer) -> list[tuple[str, str]]:
    """(weight, scale) parameter names of a layer: one pair, or one per projection of the fused experts."""
    if isinstance(layer, FusedExperts):
        return [(expert_param_name(p, "weight"), expert_param_name(p, SCALE)) for p in PROJECTIONS]
    return [("weight", SCALE)]


def part_rows(layer: Layer, weight_name: str) -> list[int]:
    """The rows of each checkpoint part stacked in a weight (q | k | v, gate | up; one part otherwise)."""
    if isinstance(layer, FusedExperts):
        return [layer.intermediate] * 2 if weight_name == "gate_up_proj" else [layer.hidden]
    return [shard.length for shard in layer.out_shards]


class Fp8BlockLinear(LinearMethod):
    """`weight` float8_e4m3fn [out, in], `weight_scale_inv` float32 [rows / g, ceil(in / 128)]."""

    name = "fp8"
    quantized = True

    def __init__(self, tile_rows: Optional[int] = TILE_ROWS):
        if tile_rows is not None and tile_rows % BLOCK:
            raise ValueError(f"tile_rows={tile_rows} must be a multiple of {BLOCK}")
        self.tile_rows = tile_rows

    def param_specs(self, out_features: int, in_features: int) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((out_features, in_features), FP8),
                SCALE: ParamSpec((out_features, ceil_div(in_features, BLOCK)), torch.float32, in_pack=BLOCK)}

    def checkpoint_tensor(self, name: str, tensor: Any, out_features: int) -> Any:
        """A checkpoint's block scales [ceil(out/128), ceil(in/128)] (float32 or bf16) -> one row per output row;
        a ValueError naming them when one is NaN or inf."""
        if name != SCALE:
            return tensor
        scale = check_scales(materialize(tensor), SCALE, tensor)
        rows = ceil_div(out_features, BLOCK)
        if scale.dim() != 2 or scale.shape[0] != rows:
            raise ValueError(f"{SCALE} of shape {tuple(scale.shape)} is not 128x128 block scales of {out_features} "
                             f"output rows ([{rows}, ceil(in / 128)]); per-tensor and per-channel FP8 scales are "
                             f"not supported")
        return expand_rows(scale, out_features)

    def dequantize(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(params["weight"], params[SCALE], dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.tile_rows is None:
            return F.linear(x, self.dequantize(layer.method_params(), x.dtype), bias)
        return linear_tiled(x, layer.weight, layer.weight_scale_inv, bias, self.tile_rows)

    def after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            for _, scale_name in weight_and_scale_names(layer):
                setattr(layer, scale_name, nn.Parameter(compact_rows(getattr(layer, scale_name)), requires_grad=False))


def linear_tiled(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                 tile_rows: int) -> torch.Tensor:
    """x [.., in] @ dequantized(q [out, in]).T -> [.., out], `tile_rows` output rows dequantized at a time into
    one scratch tile (float32 products as `dequantize_blocks`, then x's dtype), each multiplied into its
    slice of the output while it is in cache: the whole float weight never exists."""
    out_rows, cols = q.shape
    g = row_group(out_rows, scale.shape[0])
    x2d = x.reshape(-1, cols)  # [M, in]
    y = x2d.new_empty(x2d.shape[0], out_rows)
    products = torch.empty(min(tile_rows, out_rows), cols, device=q.device)  # float32 scratch, reused
    bits = torch.empty_like(products, dtype=torch.int16)
    tile = products if x.dtype == torch.float32 else torch.empty_like(products, dtype=x.dtype)
    for start in range(0, out_rows, tile_rows):  # tile_rows is a multiple of every row group g
        rows = min(start + tile_rows, out_rows) - start
        w = fp8_to_float32(q[start:start + rows], bits[:rows], products[:rows])  # [rows, in]
        multiply_by_scales(w, scale[start // g:ceil_div(start + rows, g)], g)
        w = w if tile is products else tile[:rows].copy_(w)
        torch.mm(x2d, w.t(), out=y[:, start:start + rows])
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_rows)


class Fp8CudaLinear(Fp8BlockLinear):
    """The FP8 tensors multiplied by torch's block-scaled FP8 GEMM on CUDA (opt-in: `fp8_kernel="cuda"`)."""

    name = "fp8-cuda"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = fp8_gemm(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale_inv, x.dtype)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ dequantized(q [N, K]).T -> [M, N] in `dtype`: x quantized per token and 128 columns,
    `F.scaled_mm` with 1x128 activation scales and the weight's 128x128 scales (per-row 1x128 scales
    where a shard left them finer), in the strides cuBLAS asks for."""
    from torch.nn.functional import ScalingType, scaled_mm

    m, k = x.shape
    n = q.shape[0]
    # cuBLAS's block-scaled GEMM takes a token count that is a multiple of 4: pad with zero rows
    # (CUBLAS_STATUS_NOT_SUPPORTED at M=33 on the H100, 2026-11-28)
    xq, xs = quantize_activation(F.pad(x, (0, 0, 0, -m % 4)))
    scale_a = xs.t().contiguous().t()  # [M, K/128], column-major
    kb = ceil_div(k, BLOCK)
    if row_group(n, scale.shape[0]) == BLOCK:
        padded = scale.new_zeros(scale.shape[0], ceil_div(kb, 4) * 4)  # K blocks padded to 4
        padded[:, :kb] = scale
        scale_b, recipe_b = padded.t(), ScalingType.BlockWise128x128  # [K/128 (padded), N/128], column-major
    else:
        scale_b, recipe_b = expand_rows(scale, n).t().contiguous().t(), ScalingType.BlockWise1x128  # [N, K/128]
    y = scaled_mm(xq, q.t(), scale_a, ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=torch.bfloat16)
    return y[:m].to(dtype)


class Fp8OnlineLinear(LinearMethod):
    """Online FP8: the float weight loads as it is; `after_loading` quantizes it per 128 x 128 block and
    moves the layer to `target` (a linear layer or the fused experts)."""

    name = "fp8-online"

    def __init__(self, target: Fp8BlockLinear):
        self.target = target

    def after_loading(self, layer: nn.Module) -> None:
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for weight_name, scale_name in weight_and_scale_names(layer):
                weight = getattr(layer, weight_name)  # [.., out, in]
                tensors[weight_name], tensors[scale_name] = quantize_parts(weight, part_rows(layer, weight_name))
        layer.swap_method(self.target, tensors)


def quantize_parts(weight: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [.., out, in] stacked from parts of `rows` output rows each, quantized part by part
    (so no block mixes rows of two projections, as in a converted checkpoint): (FP8 weight, scales)."""
    if len(rows) == 1:
        return quantize_weight(weight)
    pieces = [quantize_weight(part) for part in weight.split(rows, dim=-2)]
    scales = [expand_rows(scale, part.shape[-2]) for part, scale in pieces]
    return torch.cat([q for q, _ in pieces], dim=-2), compact_rows(torch.cat(scales, dim=-2))
