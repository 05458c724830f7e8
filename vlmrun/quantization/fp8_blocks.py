"""FP8 block arithmetic in plain torch: quantize to and dequantize from 128-wide blocks of `float8_e4m3fn`.

Qwen's `-FP8` checkpoints (and DeepSeek's) store a weight [out, in] as `float8_e4m3fn` values and
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: one float32 scale per 128 x 128 block (the last
row and column of blocks may be partial), the weight being `q.float() * scale` over its block.
Activations quantized for an FP8 GEMM use 1 x 128 blocks: one scale per token and 128 columns.

A layer's scales may have one row per `g` output rows for any g of `ROW_GROUPS` (128 as stored; 1
once expanded for tensor-parallel slicing; what `compact_rows` leaves): `row_group` tells g from the
shapes. `dequantize_blocks` multiplies in float32 exactly as transformers' `Fp8Dequantize` does, so a
dequantized weight is bit-equal to HF's.
"""

from __future__ import annotations

from typing import Optional

import torch

from vlmrun.layers.linear_method import ceil_div

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128  # columns per scale (and rows per scale as checkpoints store them)
ROW_GROUPS = (128, 64, 32, 16, 8, 4, 2, 1)


def quantize_blocks(x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., rows, cols] -> (q float8_e4m3fn [.., rows, cols], scale float32 [.., ceil(rows / block_rows),
    ceil(cols / 128)]) with x ~ q * scale per block: scale = the block's max |x| / 448 (1 for an all-zero
    block), partial blocks over the rows and columns they have."""
    rows, cols = x.shape[-2:]
    lead = x.shape[:-2]
    rb, cb = ceil_div(rows, block_rows), ceil_div(cols, BLOCK)
    padded = x.new_zeros(*lead, rb * block_rows, cb * BLOCK, dtype=torch.float32)
    padded[..., :rows, :cols] = x
    blocks = padded.view(*lead, rb, block_rows, cb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., rb, cb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, rb * block_rows, cb * BLOCK)[..., :rows, :cols].contiguous(), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [.., out, in] in Qwen's FP8 format: (q, weight_scale_inv [.., ceil(out/128), ceil(in/128)])."""
    return quantize_blocks(weight, BLOCK)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token 1 x 128 quantization: x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] float32)."""
    return quantize_blocks(x, 1)


def row_group(out_rows: int, scale_rows: int) -> int:
    """Output rows per scale row: the largest g of `ROW_GROUPS` with ceil(out_rows / g) == scale_rows."""
    for g in ROW_GROUPS:
        if ceil_div(out_rows, g) == scale_rows:
            return g
    raise ValueError(f"{scale_rows} scale rows fit no row group of {out_rows} output rows")


def expand_rows(scale: torch.Tensor, out_rows: int) -> torch.Tensor:
    """Block scales [.., ceil(out/g), C] -> one row per output row [.., out, C]."""
    g = row_group(out_rows, scale.shape[-2])
    return scale.repeat_interleave(g, dim=-2)[..., :out_rows, :]


def compact_rows(scale: torch.Tensor) -> torch.Tensor:
    """Per-row scales [.., rows, C] -> [.., ceil(rows / g), C] for the largest g of `ROW_GROUPS` whose
    aligned groups of rows hold equal scales (128 for a whole checkpoint tensor or a 128-aligned shard)."""
    rows = scale.shape[-2]
    for g in ROW_GROUPS:
        kept = scale[..., ::g, :]
        if torch.equal(kept.repeat_interleave(g, dim=-2)[..., :rows, :], scale):
            return kept.contiguous()
    return scale


def fp8_to_float32(q: torch.Tensor, bits: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 values of float8_e4m3fn `q`, equal to `q.float()` (NaN aside), in vectorised integer and
    float16 steps (torch's own FP8 conversion on the CPU runs element by element, ~20x slower): the bits
    s eeee mmm moved to float16's s 0eeee mmm0000000 are the value times 2^-8 (exponent bias 15 against 7;
    subnormals too), so the float16 number times 256. `bits` (int16) and `out` (float32): scratch of q's
    shape to reuse."""
    bits = q.view(torch.int8).to(torch.int16) if bits is None else bits.copy_(q.view(torch.int8))
    bits.mul_(128).bitwise_and_(-16385)  # sign-extended byte << 7; clear bit 14 (a negative's extension)
    halves = bits.view(torch.float16)
    out = halves.to(torch.float32) if out is None else out.copy_(halves)
    return out.mul_(256.0)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [.., out, in] float8 with scale [.., ceil(out/g), ceil(in/128)] -> the weight in `dtype`
    (float32 products q.float() * scale, then the cast: transformers' arithmetic)."""
    w = fp8_to_float32(q)
    return multiply_by_scales(w, scale, row_group(q.shape[-2], scale.shape[-2])).to(dtype)


def multiply_by_scales(w: torch.Tensor, scale: torch.Tensor, g: int) -> torch.Tensor:
    """w [.., out, in] float32 (FP8 values) *= its block scales [.., ceil(out/g), ceil(in/128)], in place."""
    out, cols = w.shape[-2:]
    s = scale.to(torch.float32)
    if out % g or cols % BLOCK:  # partial blocks: a scale per element
        return w.mul_(s.repeat_interleave(g, dim=-2)[..., :out, :].repeat_interleave(BLOCK, dim=-1)[..., :cols])
    w.view(*w.shape[:-2], out // g, g, cols // BLOCK, BLOCK).mul_(s[..., :, None, :, None])
    return w
