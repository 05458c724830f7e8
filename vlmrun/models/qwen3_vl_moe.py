"""Qwen3-VL-MoE: Qwen3-VL (vision tower with DeepStack, Qwen3 text with interleaved M-RoPE) with sparse MoE MLPs.

A decoder layer is MoE unless it is listed in `mlp_only_layers` (those keep a dense SwiGLU MLP) and when
(layer + 1) % decoder_sparse_step == 0. Routing: softmax over the experts, top-k, the k weights
renormalised to sum to 1; no shared expert. Expert weights load from fused tensors in either
orientation (transformers 5: [E, 2I, H] / [E, H, I]; Qwen3-VL-MoE hub checkpoints: [E, H, 2I] /
[E, I, H]) or per-expert tensors; see `vlmrun.layers.moe`.

The text stack reuses `Qwen3TextModel.forward` (splice, DeepStack, norm) with layers whose MLP is
chosen per layer; the vision tower and weight-name mapping are Qwen3-VL's.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vlmrun.layers.moe import load_checkpoint
from vlmrun.layers.norm import RMSNorm
from vlmrun.layers.rotary import MRotaryEmbedding
from vlmrun.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3MLP, Qwen3TextModel, text_head_dim
from vlmrun.models.qwen3_next import check_rope_type, is_moe_layer, moe_block
from vlmrun.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLVisionModel


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3 decoder layer (q/k-norm attention) whose MLP is given: dense or sparse MoE."""

    def __init__(self, config: Any, layer_id: int, mlp: nn.Module):
        nn.Module.__init__(self)
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Qwen3Attention(config, layer_id, qkv_bias=bias, qk_norm=True, o_bias=bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeTextModel(Qwen3TextModel):
    """`Qwen3TextModel` with MoE layers; forward (splice, DeepStack adds, final norm) is inherited."""

    def __init__(self, config: Any, rotary_emb: nn.Module):
        nn.Module.__init__(self)
        act = getattr(config, "hidden_act", "silu")

        def mlp(i: int) -> nn.Module:
            if is_moe_layer(config, i):
                return moe_block(config, shared=False, norm_topk_prob=True)
            return Qwen3MLP(config.hidden_size, config.intermediate_size, act)

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i, mlp(i)) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_emb


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    def __init__(self, config: Any):
        nn.Module.__init__(self)
        self.config = config
        text = config.text_config
        vision = config.vision_config
        self.head_dim = text_head_dim(text)
        self.num_kv_heads = text.num_key_value_heads or text.num_attention_heads
        self.num_attention_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.spatial_merge_size = vision.spatial_merge_size
        self.image_token_id = config.image_token_id
        self.video_token_id = getattr(config, "video_token_id", None)
        self.vision_start_token_id = getattr(config, "vision_start_token_id", None)
        self.num_deepstack_layers = len(vision.deepstack_visual_indexes)

        params = check_rope_type(text)
        section = params.get("mrope_section") or [24, 20, 20]
        rotary = MRotaryEmbedding(self.head_dim, float(params["rope_theta"]), list(section), interleaved=True)

        self.visual = Qwen3VLVisionModel(vision)
        self.language_model = Qwen3MoeTextModel(text, rotary)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        # transformers 5 ties by the top-level flag only (the text config's own default is True here)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self._rename)
