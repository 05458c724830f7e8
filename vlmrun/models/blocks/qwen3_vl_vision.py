"""The Qwen3-VL vision tower (also Qwen3.5's): a ViT with learned, interpolated position embeddings.

patch embed -> + bilinearly resampled learned position table -> blocks (LayerNorm, 2-D rope
attention within each image, GELU MLP) -> patch merger (2x2 patches -> one text token). Outputs of
the blocks listed in `deepstack_visual_indexes` go through their own mergers (DeepStack); the text
model adds those features to the image-token rows after its first decoder layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmrun.host_to_device import upload
from vlmrun.layers.activation import get_act_fn
from vlmrun.layers.linear import ReplicatedLinear
from vlmrun.layers.rotary import prepared_tables, rope_parameters
from vlmrun.models.blocks.vision_common import (
    GridTHW,
    Segments,
    VisionAttention,
    VisionPatchEmbed,
    VisionRotaryEmbedding,
    frame_segments,
    grid_list,
    vision_rope_positions,
)


def interpolate_pos_embed(table: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Resample a square learned position table to each image's patch grid.

    Bilinear with align_corners=True (grid corners map to table corners); patches come out in
    spatial-merge-block order, repeated per frame. table: [side * side, dim] -> [num_patches, dim].
    """
    side = int(table.shape[0] ** 0.5)
    device = table.device
    rc = vision_rope_positions(grids, merge, device)  # [num_patches, 2] (row, col)
    sizes = upload(torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids]), device)
    src = rc.float() * (side - 1) / (sizes - 1).clamp(min=1)  # [num_patches, 2] fractional table coords
    lo = src.floor()
    frac = src - lo  # [num_patches, 2]
    lo = lo.long()
    hi = (lo + 1).clamp(max=side - 1)
    (r0, c0), (r1, c1) = lo.unbind(-1), hi.unbind(-1)
    fr, fc = frac.unbind(-1)
    def rows(index: torch.Tensor) -> torch.Tensor:
        return table.index_select(0, index)  # [num_patches, dim] (index_select: several times faster than table[index])

    out = (rows(r0 * side + c0) * ((1 - fr) * (1 - fc))[:, None]
           + rows(r0 * side + c1) * ((1 - fr) * fc)[:, None]
           + rows(r1 * side + c0) * (fr * (1 - fc))[:, None]
           + rows(r1 * side + c1) * (fr * fc)[:, None])
    return out  # [num_patches, dim]


class Qwen3VLVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, hidden, bias=True)
        self.linear_fc2 = ReplicatedLinear(hidden, dim, bias=True)
        self.act_fn = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen3VLVisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3VLPatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one text-width token. `postshuffle` norms after the concat."""

    def __init__(self, config: Any, postshuffle: bool):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = ReplicatedLinear(self.merged_dim, self.merged_dim)
        self.act_fn = nn.GELU()
        self.linear_fc2 = ReplicatedLinear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_patches, vision_hidden] -> [num_patches // merge**2, out_hidden]
        if self.postshuffle:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                            config.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        head_dim = config.hidden_size // config.num_heads
        self.rotary_pos_emb = VisionRotaryEmbedding(head_dim, float(rope_parameters(config)["rope_theta"]))
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3VLPatchMerger(config, postshuffle=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(config, postshuffle=True) for _ in self.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values: [num_patches, C*T*P*P] -> (merged [num_tokens, out_hidden], deepstack list of same)."""
        grids = grid_list(grid_thw)
        device = pixel_values.device
        merge = self.spatial_merge_size
        x = self.patch_embed(pixel_values)  # [num_patches, hidden]
        x = x + interpolate_pos_embed(self.pos_embed.weight, grids, merge).to(x.dtype)
        cos, sin = prepared_tables(*self.rotary_pos_emb(vision_rope_positions(grids, merge, device)))  # [patches, 1, head_dim]
        segments = frame_segments(grids, device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, segments, cos, sin)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
