"""Qwen3-Next: the hybrid decoder (Gated DeltaNet + gated full attention, 1-D partial rope) with sparse MoE.

Decoder blocks: `blocks/hybrid_decoder.py`. MLPs: a sparse MoE block with a shared expert
(sigmoid-gated) in every layer `is_moe_layer` names, a dense SwiGLU elsewhere.

Qwen3-Next's fused GDN projections store rows grouped per key head ([q k v z] of head 0, then head 1,
...; [b a] likewise); the loader reorders them once into (q | k | v | z) and (b | a) blocks, so the
forward is two matmuls and plain splits. Loads the HF layout (`model.*`, `lm_head.*`); `mtp.*`
(multi-token prediction) weights are skipped.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.moe import is_moe_layer, moe_block
from vlmrun.layers.rotary import RotaryEmbedding, default_rope_parameters
from vlmrun.models.base import Model
from vlmrun.loader import materialize
from vlmrun.models.blocks.hybrid_decoder import GatedDeltaNet, HybridTextModel, rotary_dim
from vlmrun.parallel import SINGLE, TensorParallel


def ungroup_qkvz(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """Reorder in_proj_qkvz rows from per-key-head groups [q_g k_g v_g z_g]... to (q | k | v | z)."""
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_group_v = config.linear_num_value_heads // hk * config.linear_value_head_dim
    if weight.dim() != 2 or weight.shape[0] != hk * (2 * dk + 2 * per_group_v):
        return weight  # the loader's shape check names it
    grouped = weight.view(hk, 2 * dk + 2 * per_group_v, -1)  # [Hk, group rows, hidden]
    parts = grouped.split([dk, dk, per_group_v, per_group_v], dim=1)
    return torch.cat([p.reshape(-1, weight.shape[-1]) for p in parts])


def ungroup_ba(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """Reorder in_proj_ba rows from per-key-head groups [b_g a_g]... to (b | a)."""
    hk = config.linear_num_key_heads
    per_group = config.linear_num_value_heads // hk
    if weight.dim() != 2 or weight.shape[0] != 2 * hk * per_group:
        return weight  # the loader's shape check names it
    b, a = weight.view(hk, 2 * per_group, -1).split([per_group, per_group], dim=1)
    return torch.cat([b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])])


class Qwen3NextForCausalLM(Model):
    """`model` (HybridTextModel) + `lm_head`."""

    def __init__(self, config: Any, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        rotary = RotaryEmbedding(rotary_dim(config), float(default_rope_parameters(config)["rope_theta"]))
        self.model = HybridTextModel(config, rotary, lambda i: self.make_mlp(config, i), GatedDeltaNet, tp)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def make_mlp(self, text_config: Any, layer: int) -> nn.Module:
        if is_moe_layer(text_config, layer):
            norm_topk = bool(getattr(text_config, "norm_topk_prob", True))
            return moe_block(text_config, shared=True, norm_topk_prob=norm_topk, tp=self.tp)
        return super().make_mlp(text_config, layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        return hf_name if hf_name.startswith(("model.", "lm_head.")) else None  # mtp.* and the rest skipped

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The grouped GDN projections' output features regrouped, in whatever format their linear method
        keeps them (`LinearMethod.regroup_output`: float or FP8 rows, int4 packed along the outputs)."""
        module, _, tensor_name = name.rpartition(".")
        fn = _ungrouping(module)
        if fn is None:
            return tensor
        method = self.get_submodule(module).method
        return method.regroup_output(tensor_name, materialize(tensor), lambda rows: fn(rows, self.config))

    def lora_output_rows(self, layer: str, rows: torch.Tensor) -> torch.Tensor:
        """A LoRA B of a grouped GDN projection regrouped as its weight is."""
        fn = _ungrouping(layer)
        return rows if fn is None else fn(rows, self.config)


_GROUPED = {"linear_attn.in_proj_qkvz": ungroup_qkvz, "linear_attn.in_proj_ba": ungroup_ba}


def _ungrouping(module: str) -> Optional[Callable[[torch.Tensor, Any], torch.Tensor]]:
    """The row reordering of a grouped GDN projection (`module` ends with its name), else None."""
    return next((fn for suffix, fn in _GROUPED.items() if module.endswith(suffix)), None)
