"""The MTP layer as the training stage builds it: the weights and the maths of vlmrun's `MultiTokenPredictor`.

HF transformers drops a checkpoint's `mtp.*` weights, so training computes the layer itself, from
transformers' own Qwen3.5 modules and with the released checkpoints' names (`testing/tiny_mtp.py`):
`pre_fc_norm_embedding`, `pre_fc_norm_hidden` (zero-centred RMSNorms), `fc` (2h -> h, no bias, on
[embedding | hidden]), `layers.0` (the family's decoder layer with full attention and the MLP of layer
0) and `norm`; the model's embeddings and LM head are shared. At position p the layer takes the
model's final hidden state h_p and the embedding of token p + 1 (an image row's spliced embedding
where token p + 1 is an image token) and, at p's rotary position, predicts token p + 2.

vlmrun drafts again from the layer's own output: draft s (s >= 2) runs the layer at the position one
on from draft s - 1's, on draft s - 1's embedding and that step's output standing in for h, attending
to the layer's KV of the positions before the anchor (written from the model's hidden states) and to
the earlier drafts' KV. `unrolled` computes `depth` such steps in parallel over a teacher-forced
sequence (the drafts are the true tokens: the only case in which a later draft counts) with one
attention mask that gives each step exactly those keys, so step s at position p is vlmrun's draft s
from the anchor p - s + 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from testing.tiny_mtp import hf_mtp_decoder_layer

MTP_PREFIX = "mtp."


class MTPHead(nn.Module):
    """One MTP layer (state-dict names as in the checkpoints, less the `mtp.` prefix)."""

    def __init__(self, config: Any):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        super().__init__()
        text = config.get_text_config()
        hidden, eps = text.hidden_size, text.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([hf_mtp_decoder_layer(config)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, n, h] each -> the decoder layer's input [batch, n, h]."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def unrolled(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 depth: int) -> list[torch.Tensor]:
        """embeds [B, M, h] (of token p + 1), hidden [B, M, h] (the model's h_p), cos / sin [B, M, rot] (of p)
        -> per step s = 1 .. depth the layer's normed output [B, M, h] (step s's row p predicts token p + 2;
        rows p < s - 1 have no anchor and are meaningless). Right padding is harmless: no real row sees a later one."""
        m = embeds.shape[1]
        inputs = [self.fuse(embeds, hidden)]  # [B, M, h] per step so far
        outputs: list[torch.Tensor] = []
        for step in range(1, depth + 1):
            x = torch.cat(inputs, dim=1)  # [B, step * M, h]
            mask = draft_mask(m, step, x.device)  # [step * M, step * M]
            h = self.layers[0](x, position_embeddings=(cos.repeat(1, step, 1), sin.repeat(1, step, 1)),
                               attention_mask=mask[None, None])
            h = h[0] if isinstance(h, tuple) else h
            out = self.norm(h[:, (step - 1) * m:])  # [B, M, h]: step `step`
            outputs.append(out)
            if step < depth:  # the next step at p runs on this step's output at p - 1
                shifted = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
                inputs.append(self.fuse(embeds, shifted))
        return outputs

    def mtp_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors: every weight under `mtp.`."""
        return {MTP_PREFIX + name: t.detach().contiguous() for name, t in self.state_dict().items()}


def draft_mask(m: int, depth: int, device: torch.device) -> torch.Tensor:
    """Bool [depth * m, depth * m]: block b (draft step b + 1) at position p sees block 0 (the catch-up
    KV) at positions <= p - b and block c (1 <= c <= b) at position p - (b - c) only: the KV vlmrun's
    drafter has written when it runs draft b + 1."""
    p = torch.arange(m, device=device)
    blocks = []
    for b in range(depth):
        row = []
        for c in range(depth):
            if c == 0:
                row.append(p[None, :] <= p[:, None] - b)
            elif c <= b:
                row.append(p[None, :] == p[:, None] - (b - c))
            else:
                row.append(torch.zeros(m, m, dtype=torch.bool, device=device))
        blocks.append(torch.cat(row, dim=1))
    return torch.cat(blocks, dim=0)


class FrozenModel:
    """The stage-two model, frozen: per batch what the MTP layer reads of it, computed without gradients."""

    def __init__(self, model: Any):
        self.model = model.eval().requires_grad_(False)
        text = model.model.language_model
        first_full = text.config.layer_types.index("full_attention")
        self._seen: dict[str, Any] = {}
        text.register_forward_pre_hook(self._keep_embeds, with_kwargs=True)
        text.layers[first_full].register_forward_pre_hook(self._keep_rotary, with_kwargs=True)

    def _keep_embeds(self, module, args, kwargs) -> None:
        self._seen["embeds"] = kwargs["inputs_embeds"]  # [B, L, h]: token embeddings, image rows spliced in

    def _keep_rotary(self, module, args, kwargs) -> None:
        self._seen["rotary"] = kwargs["position_embeddings"]  # (cos, sin), each [B, L, rot]: M-RoPE of each position

    @torch.no_grad()
    def features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(embeds of token p + 1, h_p, cos_p, sin_p) for p = 0 .. L-2, each [B, L-1, .]."""
        hidden = self.model.model(**batch, use_cache=False).last_hidden_state  # [B, L, h], after the final norm
        embeds, (cos, sin) = self._seen.pop("embeds"), self._seen.pop("rotary")
        return embeds[:, 1:], hidden[:, :-1], cos[:, :-1], sin[:, :-1]

    def draft_logits(self, head: MTPHead, batch: dict[str, torch.Tensor], depth: int) -> list[torch.Tensor]:
        """Per draft step s = 1 .. depth the logits [B, L-1, vocab] of token p + 2 at each position p."""
        embeds, hidden, cos, sin = self.features(batch)
        return [self.model.lm_head(out) for out in head.unrolled(embeds, hidden, cos, sin, depth)]


def load_mtp_head(model_dir: Any, config: Any) -> MTPHead:
    """The MTP layer of a checkpoint written by the MTP stage (its `mtp.*` tensors, from any shard)."""
    from vlmrun.loader import iter_weights

    head = MTPHead(config).to(torch.float32)
    weights = {name[len(MTP_PREFIX):]: t for name, t in iter_weights(model_dir) if name.startswith(MTP_PREFIX)}
    head.load_state_dict(weights)
    return head.eval()
