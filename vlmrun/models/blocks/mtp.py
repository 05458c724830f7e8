"""The multi-token-prediction (MTP) layer of Qwen3.5 and Qwen3-Next checkpoints (weights under `mtp.`).

It predicts the token two places ahead. At position q it takes the main model's final hidden state
h_q (the one whose logits gave token q + 1) and the embedding of token q + 1, each through its own
zero-centred RMSNorm (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), concatenated as
[embedding | hidden] and projected back to the hidden size (`fc`, 2h -> h, no bias); then one gated
full-attention decoder layer of the family (its own KV-pool layer, at position q's rotary position)
and a final norm. The main model's LM head turns the result into logits for token q + 2; the result
also stands in for the main model's hidden state when the layer drafts again one position on.
The embeddings and the LM head are the main model's (the checkpoints share them).

Read from HF's layer classes and vLLM's public MTP modules (`qwen3_next_mtp.py`, `qwen3_5_mtp.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.linear import ReplicatedLinear
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.models.blocks.hybrid_decoder import FULL_ATTENTION, HybridDecoderLayer, ZeroCenteredRMSNorm, GatedDeltaNet


def num_mtp_layers(text_config: Any) -> int:
    """MTP layers a checkpoint's config announces (Qwen3.5's `mtp_num_hidden_layers`, Qwen3-Next's
    `num_nextn_predict_layers`); 0 when none."""
    return int(getattr(text_config, "mtp_num_hidden_layers", None) or
               getattr(text_config, "num_nextn_predict_layers", None) or 0)


class MultiTokenPredictor(nn.Module):
    """The checkpoint's first MTP layer. `kv_layer_id`: its KV-pool layer (after the main model's). Under
    tensor parallelism its attention heads and MLP are sharded as the model's decoder layers are; `fc`
    and the norms are whole on every rank."""

    def __init__(self, text_config: Any, make_mlp: Callable[[int], nn.Module], kv_layer_id: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        # the layer's MLP is what the family puts in decoder layer 0 (a MoE block in the MoE families)
        self.layers = nn.ModuleList([HybridDecoderLayer(text_config, FULL_ATTENTION, kv_layer_id, make_mlp(0),
                                                        GatedDeltaNet, tp)])
        self.norm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """embeds (of token q + 1), hidden (at q): [n, hidden]; cos, sin: rotary of q -> [n, hidden], normed."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)  # [n, 2h]
        h = self.layers[0](self.fc(x), cos, sin, fb)
        return self.norm(h)


def mtp_checkpoint_name(hf_name: str) -> str | None:
    """`mtp.*` checkpoint names -> this module's parameter names; everything else skipped."""
    return hf_name[len("mtp."):] if hf_name.startswith("mtp.") else None
