"""The reference Gated DeltaNet backend: torch ops over the GDN state pool, any device.

`forward` serves the `LinearAttention` layers of a hybrid model. For each sequence of the
ragged batch it reads the sequence's slot (`fb.state_slots`), runs the causal conv1d from the
slot's conv state and the gated delta rule from the slot's recurrent state, and writes both
states back:
  - a sequence feeding several tokens (prefill or a prefill chunk) runs `chunk_gated_delta_rule`
    on its own; a later chunk starts from the state the previous chunk left;
  - all sequences feeding one token (decodes) run together as one `recurrent_gated_delta_rule`
    step, gathered and scattered by slot.
The per-step split is computed once in `prepare` from host lists (no device→host sync) and kept
on `fb.linear_attn_metadata`, so a flash-linear-attention backend can take the same seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vlmrun.cache.gdn_pool import GDNPool
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import LinearAttention, LinearAttentionBackend
from vlmrun.layers.gdn_ops import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

@dataclass
class ExtendSpan:
    batch_index: int  # the sequence's index in the batch
    start: int  # its first row in the token stream
    end: int  # one past its last row


@dataclass
class GDNMetadata:
    extends: list[ExtendSpan]  # sequences feeding more than one token
    decode_rows: Optional[torch.Tensor]  # [n_decode] token rows of one-token sequences (None in a DECODE step)
    decode_slots: Optional[torch.Tensor]  # [n_decode] their GDN slots; None when no sequence feeds one token
    decode_is_whole_batch: bool  # a DECODE step: every sequence feeds one token, rows are the stream in order


class TorchGDNBackend(LinearAttentionBackend):
    """Linear-attention (GDN) layers in torch ops; full attention belongs to the backend beside it."""

    def __init__(self, pool: GDNPool):
        self.pool = pool

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.state_slots is None:
            raise ValueError("a hybrid model's ForwardBatch needs state_slots (the GDN slot of each sequence)")
        extends: list[ExtendSpan] = []
        decode_batch: list[int] = []
        decode_rows: list[int] = []
        start = 0
        for i, n in enumerate(fb.extend_seq_lens_cpu):
            if n == 1:
                decode_batch.append(i)
                decode_rows.append(start)
            else:
                extends.append(ExtendSpan(i, start, start + n))
            start += n
        whole = len(decode_batch) == fb.batch_size  # a DECODE step
        rows = slots = None
        if decode_batch and whole:
            slots = fb.state_slots
        elif decode_batch:
            device = fb.state_slots.device
            rows = torch.tensor(decode_rows, dtype=torch.int64).to(device)
            slots = fb.state_slots[torch.tensor(decode_batch, dtype=torch.int64).to(device)]
        fb.linear_attn_metadata = GDNMetadata(extends, rows, slots, bool(decode_batch) and whole)

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: LinearAttention, fb: ForwardBatch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], g [T, Hv] float32, beta [T, Hv], conv_weight [conv_dim, K] -> [T, Hv, Dv]."""
        md: GDNMetadata = fb.linear_attn_metadata
        conv_state = self.pool.conv_state[layer.layer_id]  # [slots, conv_dim, K-1]
        rec_state = self.pool.recurrent_state[layer.layer_id]  # [slots, Hv, Dv, Dk]
        if md.decode_is_whole_batch:
            return self._decode(mixed_qkv, g, beta, conv_weight, md.decode_slots, layer, conv_state, rec_state)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)  # [T, Hv, Dv]

        for span in md.extends:
            slot = fb.state_slots[span.batch_index:span.batch_index + 1]  # [1], stays on device
            y, new_conv = causal_conv1d(mixed_qkv[span.start:span.end], conv_weight, conv_state[slot][0])
            q, k, v = split_gdn_heads(y, layer)  # [n, H, D] each
            o, new_rec = chunk_gated_delta_rule(q[None], k[None], v[None], g[None, span.start:span.end],
                                                beta[None, span.start:span.end], rec_state[slot])
            conv_state[slot] = new_conv.unsqueeze(0).to(conv_state.dtype)
            rec_state[slot] = new_rec.to(rec_state.dtype)
            out[span.start:span.end] = o[0]

        if md.decode_slots is not None:
            rows = md.decode_rows
            out[rows] = self._decode(mixed_qkv[rows], g[rows], beta[rows], conv_weight, md.decode_slots, layer,
                                     conv_state, rec_state)
        return out

    def _decode(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                slots: torch.Tensor, layer: LinearAttention, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        """One token for each of n sequences: x [n, conv_dim], g/beta [n, Hv] -> [n, Hv, Dv]."""
        y, new_conv = causal_conv1d_step(x, conv_weight, conv_state[slots])
        q, k, v = split_gdn_heads(y, layer)  # [n, H, D] each
        o, new_rec = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                rec_state[slots])
        conv_state[slots] = new_conv.to(conv_state.dtype)
        rec_state[slots] = new_rec.to(rec_state.dtype)
        return o[:, 0]


def split_gdn_heads(y: torch.Tensor, layer: LinearAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output [n, conv_dim] (q | k | v) -> q, k [n, Hk, Dk] and v [n, Hv, Dv]."""
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    n = y.shape[0]
    return (q.reshape(n, layer.num_k_heads, layer.head_k_dim), k.reshape(n, layer.num_k_heads, layer.head_k_dim),
            v.reshape(n, layer.num_v_heads, layer.head_v_dim))
