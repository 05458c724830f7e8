"""Qwen2.5-VL: a windowed-attention ViT feeding a Qwen2 text decoder with sectioned M-RoPE.

Vision tower, per image of `grid_thw = (t, h, w)` patches (patches arrive in merge-block order:
each run of `merge**2` consecutive patches is one block that becomes one LLM token):

    patch embed -> reorder merge blocks window by window -> blocks (attention inside each
    `window_size`-pixel window, full per-frame attention in `fullatt_block_indexes`) ->
    patch merger (RMSNorm, concat each merge block, MLP) -> undo the window reorder

Text side: `DenseTextModel` configured as Qwen2 (q/k/v bias, no q/k norm) with sectioned M-RoPE.
The model code knows nothing of batching; the attention backend behind the `ForwardBatch` handles
the KV cache. Vision attention goes through `vision_common.varlen_attention`, the seam a fused
varlen kernel replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload
from vlmrun.layers.linear import ReplicatedLinear
from vlmrun.layers.mlp import SwiGLUMLP
from vlmrun.layers.norm import RMSNorm
from vlmrun.layers.rotary import MRotaryEmbedding, default_rope_parameters, prepared_tables
from vlmrun.models.base import Model, vl_checkpoint_name
from vlmrun.models.blocks.text_decoder import DenseTextModel, text_head_dim
from vlmrun.models.blocks.vision_common import (
    GridTHW,
    Segments,
    VisionAttention,
    VisionEmbeddings,
    VisionPatchEmbed,
    VisionRotaryEmbedding,
    frame_segments,
    grid_list,
    plan_segments,
    vision_rope_positions,
)
from vlmrun.multimodal.prompt_positions import MRopePositions, PromptPositions
from vlmrun.parallel import SINGLE, TensorParallel

# ----------------------------------------------------------------------------------------------
# Vision blocks
# ----------------------------------------------------------------------------------------------


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=1e-6)
        self.norm2 = RMSNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = SwiGLUMLP(dim, mlp_hidden, act, bias=True)

    def forward(self, x: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, dim]; segments: attention segments of this block (windows or frames)
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, concat each merge block's patches, then Linear-GELU-Linear to the LLM width."""

    def __init__(self, context_dim: int, out_dim: int, merge: int):
        super().__init__()
        self.in_dim = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(ReplicatedLinear(self.in_dim, self.in_dim), nn.GELU(), ReplicatedLinear(self.in_dim, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, context_dim], merge blocks contiguous -> [N // merge**2, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.in_dim))


# ----------------------------------------------------------------------------------------------
# Window layout: pure index arithmetic over grid_thw, on the host, once per encode call
# ----------------------------------------------------------------------------------------------


@dataclass
class VisionLayout:
    """Index tensors for one vision forward over a batch of images.

    unit_order: [num_units] merge-block index at each window-order slot (undo with argsort).
    token_order: [N] patch index at each window-order slot (each unit expanded to its merge**2 patches).
    window_lens: patches of each window, window order (windowed-attention segments; the frames,
        full attention's segments, need no reordering: the window reorder never crosses a frame).
    """

    unit_order: torch.Tensor
    token_order: torch.Tensor
    window_lens: list[int]


def _window_ids(t: int, lh: int, lw: int, win: int) -> torch.Tensor:
    """Window id of every merge unit of one image, units in (frame, row, col) order -> [t * lh * lw].

    Windows are `win` x `win` units, numbered row-major per frame; edge windows may be partial.
    """
    nwh, nww = -(-lh // win), -(-lw // win)
    frame = torch.arange(t).view(t, 1, 1)
    wrow = (torch.arange(lh) // win).view(1, lh, 1)
    wcol = (torch.arange(lw) // win).view(1, 1, lw)
    return ((frame * nwh + wrow) * nww + wcol).flatten()


def build_vision_layout(grids: list[tuple[int, int, int]], merge: int, window_units: int) -> VisionLayout:
    """Window order: image by image, window by window, units row-major inside each window."""
    unit = merge * merge
    unit_orders, window_lens = [], []
    offset = 0
    for t, h, w in grids:
        wid = _window_ids(t, h // merge, w // merge, window_units)
        unit_orders.append(torch.sort(wid, stable=True).indices + offset)  # stable: row-major inside a window
        window_lens.append(torch.bincount(wid) * unit)  # every window id in range is non-empty
        offset += wid.numel()
    unit_order = torch.cat(unit_orders)  # [num_units]
    token_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()  # [N]
    return VisionLayout(unit_order, token_order, torch.cat(window_lens).tolist())


# ----------------------------------------------------------------------------------------------
# Vision tower
# ----------------------------------------------------------------------------------------------


class Qwen2_5_VisionTower(nn.Module):
    """pixel_values [N, C * tp * p * p] + grids -> merged embeddings [N // merge**2, out_hidden_size]."""

    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window_units = vc.window_size // vc.spatial_merge_size // vc.patch_size  # merge units per window side
        if self.window_units < 1:
            raise ValueError(f"window_size {vc.window_size} is smaller than one merge block "
                             f"({vc.spatial_merge_size} x {vc.patch_size} px)")
        self.fullatt_blocks = frozenset(vc.fullatt_block_indexes)
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.patch_embed = VisionPatchEmbed(vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.hidden_size,
                                            bias=False)
        self.rotary_pos_emb = VisionRotaryEmbedding(vc.hidden_size // vc.num_heads, theta)
        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, vc.intermediate_size, vc.hidden_act) for _ in range(vc.depth)
        )
        self.merger = PatchMerger(vc.hidden_size, vc.out_hidden_size, self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        grids = grid_list(grid_thw)
        layout = build_vision_layout(grids, self.merge, self.window_units)
        device = pixel_values.device
        token_order = upload(layout.token_order, device)
        x = self.patch_embed(pixel_values)[token_order]  # [N, dim], window order
        pos_hw = vision_rope_positions(grids, self.merge)[layout.token_order]  # [N, 2], window order (host)
        cos, sin = prepared_tables(*self.rotary_pos_emb(upload(pos_hw, device)))  # [N, 1, head_dim] each, every block
        windows, frames = plan_segments(layout.window_lens, device), frame_segments(grids, device)
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.fullatt_blocks else windows, cos, sin)
        merged = self.merger(x)  # [num_units, out], window order
        return merged[upload(torch.argsort(layout.unit_order), device)]  # image order


# ----------------------------------------------------------------------------------------------
# The full model
# ----------------------------------------------------------------------------------------------

def _mrope_rotary(text_config) -> MRotaryEmbedding:
    """Sectioned (non-interleaved) M-RoPE from the text config; HF's default sections are [16, 24, 24]."""
    params = default_rope_parameters(text_config)
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    section = list(params.get("mrope_section") or [16, 24, 24])
    return MRotaryEmbedding(head_dim, float(params["rope_theta"]), section, interleaved=False)


class Qwen2_5_VLForConditionalGeneration(Model):
    """`visual` (Qwen2.5 ViT) + `language_model` (Qwen2-style text stack) + `lm_head`.

    Loads transformers-5 names (`model.language_model.*`, `model.visual.*`) and the original hub
    names (`model.layers.*`, `model.embed_tokens.*`, `model.norm.*`, `visual.*`); `lm_head.*`.
    """

    supports_images = True

    @classmethod
    def prompt_positions(cls, hf_config: Any) -> PromptPositions:
        """M-RoPE; a video's temporal row steps by its seconds per group (`tokens_per_second`)."""
        return MRopePositions(hf_config)

    def __init__(self, config, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        text, vision = config.text_config, config.vision_config
        head_dim = text.hidden_size // text.num_attention_heads  # HF ignores any head_dim here
        if text_head_dim(text) != head_dim:
            raise ValueError(f"Qwen2.5-VL text head_dim must be hidden_size // num_attention_heads = "
                             f"{head_dim}, config says {text_head_dim(text)}")
        if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
            raise NotImplementedError("Qwen2.5-VL sliding-window text layers are not supported")
        self.visual = Qwen2_5_VisionTower(vision)
        self.language_model = DenseTextModel(text, _mrope_rotary(text), lambda i: self.make_mlp(text, i), qkv_bias=True,
                                             qk_norm=False, tp=tp)
        self.lm_head = self.make_lm_head(self.language_model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """input_ids: [T]; positions: [3, T] M-RoPE rows; image rows come from fb.mm_mask / fb.mm_embeds."""
        return self.language_model(input_ids, positions, fb)  # [T, hidden]

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | GridTHW) -> VisionEmbeddings:
        """pixel_values: [num_patches, C * tp * p * p]; grid_thw: [num_images, 3]. Rows image by image."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        embeds = self.visual(pixel_values.to(dtype), grid_thw)  # [num_image_tokens, hidden]
        return VisionEmbeddings(embeds=embeds)

    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        return vl_checkpoint_name(hf_name)
