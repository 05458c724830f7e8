"""Qwen3.5 and Qwen3.5-MoE: the Qwen3-VL vision tower (without DeepStack) on the hybrid Gated DeltaNet / gated-attention text model.

Vision tower: `blocks/qwen3_vl_vision.py`; Qwen3.5 has no DeepStack mergers, so `encode_images`
returns no extras. Text model: `HybridTextModel` (`blocks/hybrid_decoder.py`) per
`text_config.layer_types`, with
- GDN layers whose projections are separate: `in_proj_qkv` (q | k | v), `in_proj_z`, `in_proj_b`, `in_proj_a`;
- gated full attention with interleaved M-RoPE on the first head_dim * partial_rotary_factor dims
  (`mrope_section` splits those rotary frequencies between t, h, w);
- zero-centred RMSNorms and a dense SwiGLU MLP; Qwen3.5-MoE has a sparse MoE block in every layer
  (softmax top-k renormalised, plus a sigmoid-gated shared expert).
M-RoPE positions for images and videos are Qwen3-VL's (`prompt_positions`, `vlmrun.multimodal.prompt_positions`).

Internal parameter names: `visual.*`, `language_model.*`, `lm_head.*`; checkpoints load in the
transformers-5 layout (`model.visual.*`, `model.language_model.*`, `lm_head.*`) or the hub layout
(`visual.*`, `model.*`, `lm_head.*`); `mtp.*` weights (multi-token prediction) are skipped.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.linear import ColumnParallelLinear
from vlmrun.layers.moe import moe_block
from vlmrun.layers.rotary import MRotaryEmbedding, default_rope_parameters
from vlmrun.models.base import Model, vl_checkpoint_name
from vlmrun.models.blocks.hybrid_decoder import GatedDeltaNet, HybridTextModel, rotary_dim
from vlmrun.models.blocks.qwen3_vl_vision import Qwen3VLVisionModel
from vlmrun.models.blocks.vision_common import GridTHW, VisionEmbeddings
from vlmrun.multimodal.prompt_positions import MRopePositions, PromptPositions
from vlmrun.parallel import SINGLE, TensorParallel


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """GDN with separate projections: in_proj_qkv (q | k | v), in_proj_z, in_proj_b, in_proj_a."""

    def _init_projections(self, hidden: int) -> None:
        self.in_proj_qkv = ColumnParallelLinear(hidden, [self.k_shard, self.k_shard, self.v_shard])
        self.in_proj_z = ColumnParallelLinear(hidden, [self.v_shard])
        self.in_proj_b = ColumnParallelLinear(hidden, [self.head_shard])
        self.in_proj_a = ColumnParallelLinear(hidden, [self.head_shard])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


class _NoDeepStack:
    """A read-only view of a vision config that names no DeepStack layers."""

    deepstack_visual_indexes: tuple[int, ...] = ()

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Qwen3_5ForConditionalGeneration(Model):
    supports_images = True

    @classmethod
    def prompt_positions(cls, hf_config: Any) -> PromptPositions:
        """M-RoPE; a video comes as one item per temporal group, its timestamps in the text."""
        return MRopePositions(hf_config)

    def __init__(self, config: Any, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        text = config.text_config
        params = default_rope_parameters(text)
        section = list(params.get("mrope_section") or [11, 11, 10])
        rotary = MRotaryEmbedding(rotary_dim(text), float(params["rope_theta"]), section, interleaved=True)
        self.visual = Qwen3VLVisionModel(_NoDeepStack(config.vision_config))
        self.language_model = HybridTextModel(text, rotary, lambda i: self.make_mlp(text, i), Qwen3_5GatedDeltaNet,
                                              tp)
        self.lm_head = self.make_lm_head(self.language_model.embed_tokens)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> VisionEmbeddings:
        embeds, _ = self.visual(pixel_values, grid_thw)
        return VisionEmbeddings(embeds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, fb)

    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        return vl_checkpoint_name(hf_name)  # mtp.* and the rest skipped


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    def make_mlp(self, text_config: Any, layer: int) -> nn.Module:
        return moe_block(text_config, shared=True, norm_topk_prob=True, tp=self.tp)
