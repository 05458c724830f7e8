"""Qwen3.5-MoE: Qwen3.5 (vision tower + hybrid GDN / gated-attention text model) with a sparse MoE MLP in every layer.

The MoE block routes each token to its top-k experts (softmax over all experts, the k weights
renormalised to sum to 1) and adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
Expert weights load from fused (`experts.gate_up_proj`, `experts.down_proj`) or per-expert
(`experts.{e}.gate_proj.weight`, ...) checkpoint tensors; see `vlmrun.layers.moe`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmrun.models.qwen3_5 import Qwen3_5ForConditionalGeneration
from vlmrun.models.qwen3_next import moe_block


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    @staticmethod
    def make_mlp(text: Any, layer_idx: int) -> nn.Module:
        return moe_block(text, shared=True, norm_topk_prob=True)
