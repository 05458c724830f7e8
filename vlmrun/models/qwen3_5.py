"""Qwen3.5: the Qwen3-VL vision tower (without DeepStack) on a hybrid Gated DeltaNet / gated-attention text model.

Vision tower: Qwen3-VL's (patch embed + interpolated learned positions + 2-D rope blocks + merger);
Qwen3.5 has no DeepStack mergers, so `encode_images` returns no deepstack features.
Text model: `HybridTextModel` (see `qwen3_next.py`) per `text_config.layer_types`, with
- GDN layers whose projections are separate: `in_proj_qkv` (q | k | v), `in_proj_z`, `in_proj_b`, `in_proj_a`;
- gated full attention with interleaved M-RoPE on the first head_dim * partial_rotary_factor dims
  (`mrope_section` splits those rotary frequencies between t, h, w);
- zero-centred RMSNorms and a dense SwiGLU MLP (Qwen3.5-MoE swaps in the sparse MoE block).
M-RoPE positions for images are Qwen3-VL's (`vlmrun.multimodal.mrope`).

Internal parameter names: `visual.*`, `language_model.*`, `lm_head.*`. `load_weights` accepts the
transformers-5 layout (`model.visual.*`, `model.language_model.*`, `lm_head.*`) and the hub layout
(`visual.*`, `model.*`, `lm_head.*`); `mtp.*` weights (multi-token prediction) are skipped.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.moe import load_checkpoint
from vlmrun.layers.rotary import MRotaryEmbedding
from vlmrun.layers.mlp import SwiGLUMLP
from vlmrun.models.qwen3_next import (
    GatedDeltaNet,
    HybridTextModel,
    check_rope_type,
    rotary_dim,
    set_hybrid_attributes,
)
from vlmrun.models.qwen3_vl import Qwen3VLVisionModel
from vlmrun.models.vision_common import GridTHW, VisionEmbeddings


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """GDN with separate projections: in_proj_qkv (q | k | v), in_proj_z, in_proj_b, in_proj_a."""

    def _init_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


class _NoDeepStack:
    """A read-only view of a vision config that names no DeepStack layers."""

    deepstack_visual_indexes: tuple[int, ...] = ()

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Qwen3_5ForConditionalGeneration(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        text = config.text_config
        vision = config.vision_config
        set_hybrid_attributes(self, text)
        self.spatial_merge_size = vision.spatial_merge_size
        self.image_token_id = config.image_token_id
        self.video_token_id = getattr(config, "video_token_id", None)
        self.vision_start_token_id = getattr(config, "vision_start_token_id", None)
        self.num_deepstack_layers = 0

        params = check_rope_type(text)
        section = list(params.get("mrope_section") or [11, 11, 10])
        rotary = MRotaryEmbedding(rotary_dim(text), float(params["rope_theta"]), section, interleaved=True)

        self.visual = Qwen3VLVisionModel(_NoDeepStack(vision))
        self.language_model = HybridTextModel(text, rotary, lambda i: self.make_mlp(text, i), Qwen3_5GatedDeltaNet)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))  # the top-level flag, as transformers 5
        if self.tied:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    @staticmethod
    def make_mlp(text: Any, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer `layer_idx` (dense SwiGLU; the MoE variant overrides this)."""
        return SwiGLUMLP(text.hidden_size, text.intermediate_size, getattr(text, "hidden_act", "silu"))

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> VisionEmbeddings:
        embeds, _ = self.visual(pixel_values, grid_thw)
        return VisionEmbeddings(embeds, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [n, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self._rename)

    def _rename(self, name: str) -> str | None:
        """Checkpoint name -> our parameter name (None to skip)."""
        for prefix, ours in (("model.language_model.", "language_model."), ("model.visual.", "visual."),
                             ("visual.", "visual."), ("model.", "language_model.")):
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        if name.startswith("lm_head."):
            return None if self.tied else name
        return None  # mtp.* and anything else
