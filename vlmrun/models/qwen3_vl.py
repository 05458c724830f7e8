"""Qwen3-VL and Qwen3-VL-MoE: the Qwen3-VL vision tower (DeepStack) on a Qwen3 text model with interleaved M-RoPE.

Vision tower: `blocks/qwen3_vl_vision.py`. Text model: `DenseTextModel`; in Qwen3-VL-MoE a decoder
layer's MLP is a sparse MoE block (softmax routing, top-k renormalised, no shared expert) unless
the layer is listed in `mlp_only_layers` or falls between `decoder_sparse_step`s.

Internal parameter names: `visual.*`, `language_model.*`, `lm_head.*`; checkpoints load in the
transformers-5 layout (`model.visual.*`, `model.language_model.*`, `lm_head.*`) or the hub layout
(`visual.*`, `model.*`, `lm_head.*`); MoE experts fused, transposed or per expert.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.moe import is_moe_layer, moe_block
from vlmrun.layers.rotary import MRotaryEmbedding, default_rope_parameters
from vlmrun.models.base import Model, vl_checkpoint_name
from vlmrun.models.blocks.qwen3_vl_vision import Qwen3VLVisionModel
from vlmrun.models.blocks.text_decoder import DEEPSTACK, DenseTextModel, text_head_dim
from vlmrun.models.blocks.vision_common import GridTHW, VisionEmbeddings
from vlmrun.multimodal.prompt_positions import MRopePositions, PromptPositions
from vlmrun.parallel import SINGLE, TensorParallel


class Qwen3VLForConditionalGeneration(Model):
    supports_images = True
    mm_extras = (DEEPSTACK,)  # [k, num_image_tokens, hidden]: added to the image rows after text layer i < k

    @classmethod
    def prompt_positions(cls, hf_config: Any) -> PromptPositions:
        """M-RoPE; a video comes as one item per temporal group, its timestamps in the text."""
        return MRopePositions(hf_config)

    def __init__(self, config: Any, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        text = config.text_config
        params = default_rope_parameters(text)
        section = params.get("mrope_section") or [24, 20, 20]
        rotary = MRotaryEmbedding(text_head_dim(text), float(params["rope_theta"]), list(section), interleaved=True)
        self.visual = Qwen3VLVisionModel(config.vision_config)
        bias = bool(getattr(text, "attention_bias", False))
        self.language_model = DenseTextModel(text, rotary, lambda i: self.make_mlp(text, i), qkv_bias=bias,
                                             o_bias=bias, tp=tp)
        self.lm_head = self.make_lm_head(self.language_model.embed_tokens)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> VisionEmbeddings:
        embeds, deepstack = self.visual(pixel_values, grid_thw)
        return VisionEmbeddings(embeds, {DEEPSTACK: torch.stack(deepstack)} if deepstack else {})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, fb)

    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        return vl_checkpoint_name(hf_name)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL with sparse MoE MLPs in the text layers; everything else is Qwen3-VL's."""

    def make_mlp(self, text_config: Any, layer: int) -> nn.Module:
        if is_moe_layer(text_config, layer):
            return moe_block(text_config, shared=False, norm_topk_prob=True, tp=self.tp)
        return super().make_mlp(text_config, layer)
