"""Qwen3-VL-MoE: Qwen3-VL (vision tower with DeepStack, Qwen3 text with interleaved M-RoPE) with sparse MoE MLPs.

A decoder layer is MoE unless it is listed in `mlp_only_layers` (those keep a dense SwiGLU MLP) and when
(layer + 1) % decoder_sparse_step == 0. Routing: softmax over the experts, top-k, the k weights
renormalised to sum to 1; no shared expert. Expert weights load from fused tensors in either
orientation (transformers 5: [E, 2I, H] / [E, H, I]; Qwen3-VL-MoE hub checkpoints: [E, H, 2I] /
[E, I, H]) or per-expert tensors; see `vlmrun.layers.moe`.

Only the per-layer MLP and the embedding tie differ from Qwen3-VL (hooks of its model class); the
vision tower, text stack and weight-name mapping are Qwen3-VL's.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from vlmrun.layers.moe import load_checkpoint
from vlmrun.models.qwen3_next import is_moe_layer, moe_block
from vlmrun.models.qwen3_vl import Qwen3VLForConditionalGeneration


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL with sparse MoE MLPs in the text layers; everything else is Qwen3-VL's."""

    def make_text_mlp(self, text_config: Any, layer: int) -> Optional[nn.Module]:
        if is_moe_layer(text_config, layer):
            return moe_block(text_config, shared=False, norm_topk_prob=True)
        return None

    def ties_embeddings(self, config: Any) -> bool:
        # transformers 5 ties by the top-level flag only (the text config's own default is True here)
        return bool(getattr(config, "tie_word_embeddings", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self._rename)
