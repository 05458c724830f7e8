"""Pieces shared by the Qwen vision towers (Qwen2.5-VL, Qwen3-VL).

- `VisionEmbeddings`: what `encode_images` returns.
- `VisionPatchEmbed`: the Conv3d patch embedding, computed as one matmul over flattened patches
  (the parameter keeps the Conv3d shape, so checkpoint names and shapes load unchanged).
- `VisionRotaryEmbedding` + `vision_rope_positions`: 2-D (h, w) rotary for patches laid out in
  spatial-merge-block order.
- `plan_segments` / `frame_segments`: the attention segments, planned on the host from the grid (a
  host list) and uploaded without blocking, so the tower reads nothing back from the device.
- `VisionAttention` and `varlen_attention`: non-causal attention restricted to each image (frame);
  `fused_varlen_attention` (torch's flash-attention varlen kernel, CUDA fp16/bf16) takes its place
  with the CUDA fast path (`use_fused_vision_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.host_to_device import upload
from vlmrun.layers.cpu_kernels import patch_embed_as_gemm
from vlmrun.layers.linear import ReplicatedLinear
from vlmrun.layers.rotary import apply_rotary

GridTHW = Union[torch.Tensor, Sequence[Sequence[int]]]


@dataclass
class VisionEmbeddings:
    """Image embeddings in the text model's hidden size, image by image (t*h*w // merge**2 rows each)."""

    embeds: torch.Tensor  # [num_image_tokens_total, hidden]
    # The model's own extras beside the embeddings, by the names its class lists in `Model.mm_extras` (Qwen3-VL:
    # DeepStack features). Each holds its image rows on the second-to-last dim, [..., num_image_tokens_total, d],
    # so the vision stage slices, caches and batches them as it does the embeddings, without knowing what they are.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def grid_list(grid_thw: GridTHW) -> list[tuple[int, int, int]]:
    """Normalize grid_thw ([n, 3] tensor or sequence of triples) to a host list of int triples (the engine
    passes host triples: a grid tensor on the device would be read back here, a sync)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


@dataclass(frozen=True)
class Segments:
    """The vision tower's attention segments (each attends only to itself), planned once per encode
    from host lengths, so no layer reads them back from the device.

    cu_seqlens: [num_segments + 1] int32 boundaries on the device (the fused varlen kernel's input);
    max_len: the longest segment; runs: per distinct length, the rows of all segments of that length
    ([num_segments_of_that_length * length] int64 on the device; the reference kernel batches them).
    """

    cu_seqlens: torch.Tensor
    max_len: int
    runs: list[tuple[int, torch.Tensor]]


def plan_segments(lengths: list[int], device: torch.device | None = None) -> Segments:
    """Segments of the given lengths (in patches, in stream order); empty ones are skipped."""
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for n in lengths:
        if n > 0:
            starts_by_length.setdefault(n, []).append(start)
        start += n
    runs = [(n, _to(device, (torch.tensor(starts)[:, None] + torch.arange(n)).flatten()))
            for n, starts in starts_by_length.items()]
    cu = _to(device, F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)))
    return Segments(cu, max(lengths, default=0), runs)


def _to(device: torch.device | None, host: torch.Tensor) -> torch.Tensor:
    """A host-planned tensor on `device` (None: stays on the host), uploaded without blocking."""
    return host if device is None else upload(host, device)


def frame_segments(grids: list[tuple[int, int, int]], device: torch.device | None = None) -> Segments:
    """Full-attention segments: each frame (h*w patches) of each image attends only to itself."""
    return plan_segments([h * w for t, h, w in grids for _ in range(t)], device)


def vision_rope_positions(grids: list[tuple[int, int, int]], merge: int,
                          device: torch.device | None = None) -> torch.Tensor:
    """(row, col) of every patch in spatial-merge-block order, repeated per frame -> [num_patches, 2]."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # block order: (block_row, block_col, in_row, in_col)
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)  # [num_patches, 2]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     scale: float | None = None) -> torch.Tensor:
    """Non-causal attention within each segment.

    q, k, v: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    Reference implementation: segments of equal length (same-size images, full windows) are
    gathered into one batched SDPA call, one call per distinct length. A fused varlen kernel
    replaces this function on GPU.
    """
    out = torch.empty_like(q)
    for length, rows in segments.runs:  # rows: [num_segments * length]
        count = rows.numel() // length
        qs, ks, vs = (x.index_select(0, rows).view(count, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [num_segments, heads, length, head_dim]
        out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def fused_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                           scale: float | None = None) -> torch.Tensor:
    """`varlen_attention` as one flash-attention varlen call over every segment (CUDA, fp16/bf16)."""
    from torch.nn.attention.varlen import varlen_attn

    cu, n = segments.cu_seqlens, segments.max_len
    return varlen_attn(q, k, v, cu, cu, n, n, scale=scale)


def use_fused_vision_attention(model: nn.Module) -> int:
    """Switch every vision attention of `model` to the fused varlen kernel; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, VisionAttention)]
    for layer in layers:
        layer.varlen = fused_varlen_attention
    return len(layers)


class VisionPatchEmbed(nn.Module):
    """Conv3d with kernel == stride over pre-flattened patches.

    Mathematically a linear layer, run as one or the other by `cpu_kernels.patch_embed_as_gemm`. In
    float32 on CPU it runs as the conv HF runs, so the sums round the same way (a matmul differs by
    ~1e-5, which the CPU parity tests would see). On CUDA it runs as the matmul: cuDNN would run the
    conv in TF32 (torch's default for convolutions), which put float32 image prompts 4e-3 to 2.5e-2
    off the CPU engine in logprob (measured on an H100). In bfloat16 on CPU the GEMM, 3-4.7x faster
    than oneDNN's conv on AVX-512 and AVX2 alike.
    """

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int, bias: bool):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.embed_dim = embed_dim
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [num_patches, in_channels * temporal_patch * patch * patch] -> [num_patches, embed_dim]
        weight = self.proj.weight  # [embed_dim, C, T, P, P]
        if patch_embed_as_gemm(weight.device, weight.dtype):
            return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)
        patches = pixel_values.to(weight.dtype).view(-1, *weight.shape[1:])  # [num_patches, C, T, P, P]
        return self.proj(patches).view(-1, self.embed_dim)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2-D rope: head_dim // 4 frequencies for rows, the same for columns, rotate-half layout."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 4]

    def forward(self, pos_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos_hw: [num_patches, 2] -> cos, sin: [num_patches, head_dim]
        freqs = (pos_hw.float()[..., None] * self.inv_freq).flatten(1)  # [num_patches, head_dim // 2] (h | w)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Fused-qkv multi-head attention with 2-D rope, restricted to segments."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)
        self.varlen = varlen_attention  # the kernel; `use_fused_vision_attention` swaps it

    def forward(self, x: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [num_patches, heads, head_dim]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.varlen(q, k, v, segments, scale=self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))
