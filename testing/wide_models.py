"""Wide tiny checkpoints: the tiny test models (`testing.tiny_models`) with widths of 256 and more.

Quantized formats work in blocks and groups of 128 input (and output) features: FP8 block-wise
scales cover 128 x 128 weights, AWQ / GPTQ scales 128 input columns. On the 64-wide tiny models
every layer is one partial block, so nothing of the blocking is tested. `build_wide_checkpoint`
builds the same architectures (tokenizer, processors, generation config, float32 safetensors, 2-4
layers, 4 experts) with every quantizable width a multiple of 128, except one layer per
architecture (`ODD_WIDTH` = 320 = 2.5 blocks: the dense MLP's intermediate, or the shared
expert's where every MLP is MoE; the vision MLP's too) so partial last blocks are real.

What stays aligned: hidden 256, attention 4 heads x 64 (q 256, k / v 128), MoE experts 512 wide
(never square, so a transposed fused layout is told apart; under tensor parallelism each expert's
down projection splits into 256-wide input halves), GDN
2 key heads and 4 value heads of 64 dims, the vision tower 256 wide with 4 heads. The per-arch
constraints hold: M-RoPE sections sum to half the rotary dims, the vision tower's output width is
the text hidden size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testing.tiny_models import ARCHS, build_tiny_checkpoint

WIDE_HIDDEN = 256
WIDE_HEADS = 4
WIDE_KV_HEADS = 2
WIDE_HEAD_DIM = 64
ODD_WIDTH = 320  # not a multiple of 128: 2 whole blocks and a half one
EXPERT_WIDTH = 512  # not the hidden size: an expert tensor is never square, so a transposed layout shows
VISION_HIDDEN = 256
VISION_HEADS = 4
GDN_KEY_HEADS = 2
GDN_VALUE_HEADS = 4
GDN_HEAD_DIM = 64


def _text(arch: str) -> dict[str, Any]:
    """The text config fields each arch's wide checkpoint sets (over the tiny ones)."""
    text: dict[str, Any] = dict(hidden_size=WIDE_HIDDEN, num_attention_heads=WIDE_HEADS,
                                num_key_value_heads=WIDE_KV_HEADS, intermediate_size=ODD_WIDTH)
    if arch != "qwen2_5_vl":  # Qwen2.5-VL's head_dim is hidden / heads (64)
        text["head_dim"] = WIDE_HEAD_DIM
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]}
    elif arch in ("qwen3_vl", "qwen3_vl_moe"):
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [16, 8, 8],
                                   "mrope_interleaved": True}
    elif arch in ("qwen3_5", "qwen3_5_moe"):  # rotary: 0.25 of 64 = 16 dims, 8 frequencies
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000_000.0, "mrope_section": [4, 2, 2],
                                   "mrope_interleaved": True, "partial_rotary_factor": 0.25}
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        text.update(linear_num_key_heads=GDN_KEY_HEADS, linear_num_value_heads=GDN_VALUE_HEADS,
                    linear_key_head_dim=GDN_HEAD_DIM, linear_value_head_dim=GDN_HEAD_DIM)
    if arch in ("qwen3_5_moe", "qwen3_next", "qwen3_vl_moe"):
        text["moe_intermediate_size"] = EXPERT_WIDTH
    if arch == "qwen3_5_moe":  # every layer MoE: the shared expert is the odd one
        del text["intermediate_size"]
        text["shared_expert_intermediate_size"] = ODD_WIDTH
    elif arch == "qwen3_next":
        text["shared_expert_intermediate_size"] = WIDE_HIDDEN
    return text


def _vision(arch: str) -> dict[str, Any]:
    if arch in ("qwen3", "qwen3_next"):
        return {}
    return dict(hidden_size=VISION_HIDDEN, num_heads=VISION_HEADS, intermediate_size=ODD_WIDTH,
                out_hidden_size=WIDE_HIDDEN)


def wide_overrides(arch: str) -> dict[str, dict[str, Any]]:
    """`build_tiny_checkpoint`'s overrides for the wide copy of `arch`."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    vision = _vision(arch)
    return {"text": _text(arch), **({"vision": vision} if vision else {})}


def build_wide_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the wide tiny checkpoint of `arch` (one of `testing.tiny_models.ARCHS`) in out_dir; returns out_dir."""
    return build_tiny_checkpoint(arch, out_dir, seed, overrides=wide_overrides(arch))
