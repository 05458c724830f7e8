"""The CUDA Gated DeltaNet backend: flash-linear-attention's Triton kernels over the GDN state pool.

Same seam and same results as `TorchGDNBackend` (the reference it is tested against):
  - extend (any batch with a multi-token sequence): every sequence of the step — prefill chunks
    and one-token decodes alike — runs as one variable-length batch: FLA's `causal_conv1d` with
    `cu_seqlens`, then `chunk_gated_delta_rule` with `cu_seqlens`, each starting from the states
    gathered from the sequences' slots and returning the final states, written back;
  - decode: `causal_conv1d_update` and `fused_recurrent_gated_delta_rule` over one token per
    sequence, states gathered and written back by slot (static shapes: CUDA-graph capturable);
  - a step with draft tokens (speculative decoding's verify pass, `fb.num_drafts_cpu`) runs whole on
    the reference, a `TorchGDNBackend` over the same pool (torch ops, on CUDA): it keeps the conv and
    recurrent states after every position of each draft-carrying sequence and `keep_accepted_states`
    puts those after the accepted positions into the slots. FLA 0.6's kernels return only a
    sequence's final state. Such a step's other sequences (decodes, prefill chunks) run there too.
    The pool's layout is the reference's: a step on either backend starts from the states the other left.
FLA keeps the last K conv inputs where the pool keeps K-1: the oldest column is padded with zeros
on the way in (the kernel shifts it out) and dropped on the way out. The recurrent state is
float32 in the pool's [Hv, Dv, Dk] layout (FLA's `state_v_first`).
FLA 0.6's kernels take no slot indices: they read their initial states from, and write their final
states to, tensors with one state per sequence. So a step moves each sequence's recurrent state three
times per layer — gathered from the pool, through the kernel, written back — where a kernel that
reads and writes the pool by slot would move it once (vLLM and SGLang carry such a fork of this
kernel). Nothing else is copied: the dtype casts are no-ops for the float32 pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F

from vlmrun.cache.gdn_pool import GDNPool
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import LinearAttention, LinearAttentionBackend
from vlmrun.layers.attention.torch_gdn_backend import GDNMetadata, TorchGDNBackend
from vlmrun.layers.gdn_ops import split_gdn_heads


@dataclass
class FLAMetadata:
    decode: bool  # every sequence feeds one token
    cu_seqlens: Optional[torch.Tensor]  # [batch + 1] int64 on the device (extend only)
    cu_seqlens_cpu: Optional[torch.Tensor]  # the same on the host (FLA plans its chunks from it)


class FLAGDNBackend(LinearAttentionBackend):
    verifies_drafts = True  # steps with drafts run on `self.reference`

    def __init__(self, pool: GDNPool):
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self.pool = pool
        self._conv, self._conv_update = causal_conv1d, causal_conv1d_update
        self._chunk, self._recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self.reference = TorchGDNBackend(pool)  # serves the steps with drafts (verify passes)

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.state_slots is None:
            raise ValueError("a hybrid model's ForwardBatch needs state_slots (the GDN slot of each sequence)")
        if fb.num_drafts_cpu is not None and any(fb.num_drafts_cpu):
            self.reference.prepare(fb)  # its GDNMetadata on fb: `forward` and `keep_accepted_states` follow it
        else:
            fb.linear_attn_metadata = gdn_varlen_metadata(fb)

    def keep_accepted_states(self, metadata: Any, num_accepted: Any) -> None:
        """A verify step's (the reference's metadata); a step without drafts kept nothing."""
        if isinstance(metadata, GDNMetadata):
            self.reference.keep_accepted_states(metadata, num_accepted)

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: LinearAttention, fb: ForwardBatch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], g [T, Hv] float32, beta [T, Hv], conv_weight [conv_dim, K] -> [T, Hv, Dv]."""
        if isinstance(fb.linear_attn_metadata, GDNMetadata):  # a step with drafts, prepared by the reference
            return self.reference.forward(mixed_qkv, g, beta, conv_weight, layer, fb)
        md = cast(FLAMetadata, fb.linear_attn_metadata)
        slots = fb.state_slots  # [batch]
        conv_state = self.pool.conv_state[layer.layer_id]  # [slots, conv_dim, K-1]
        rec_state = self.pool.recurrent_state[layer.layer_id]  # [slots, Hv, Dv, Dk]
        conv_in = F.pad(conv_state[slots], (1, 0)).to(mixed_qkv.dtype)  # [batch, conv_dim, K]
        state_in = rec_state[slots].to(torch.float32)  # [batch, Hv, Dv, Dk]
        if md.decode:
            y, _ = self._conv_update(mixed_qkv, cache=conv_in, weight=conv_weight,
                                     activation="silu")  # conv_in updated in place
            q, k, v = (t.unsqueeze(1) for t in split_gdn_heads(y, layer))  # [batch, 1, H, D]
            # every optional argument by keyword: after g, FLA's next positional parameter is gk (a per-key decay)
            out, state_out = self._recurrent(q, k, v, g=g.unsqueeze(1), beta=beta.unsqueeze(1),
                                             initial_state=state_in, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, state_v_first=True)
            conv_out = conv_in
        else:
            y, conv_out = self._conv(mixed_qkv.unsqueeze(0), weight=conv_weight, initial_state=conv_in,
                                     output_final_state=True, activation="silu", cu_seqlens=md.cu_seqlens,
                                     cu_seqlens_cpu=md.cu_seqlens_cpu)
            q, k, v = (t.unsqueeze(0) for t in split_gdn_heads(y[0], layer))  # [1, T, H, D]
            out, state_out = self._chunk(q, k, v, g=g.unsqueeze(0), beta=beta.unsqueeze(0), initial_state=state_in,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         state_v_first=True, cu_seqlens=md.cu_seqlens,
                                         cu_seqlens_cpu=md.cu_seqlens_cpu)
        conv_state[slots] = conv_out[..., 1:].to(conv_state.dtype)
        rec_state[slots] = state_out.to(rec_state.dtype)
        return out.squeeze(1) if md.decode else out[0]  # [T, Hv, Dv]


def gdn_varlen_metadata(fb: ForwardBatch) -> FLAMetadata:
    """The step's sequences as FLA's variable-length batch: cu_seqlens from the host lengths (no sync)."""
    if fb.mode is ForwardMode.DECODE:
        return FLAMetadata(decode=True, cu_seqlens=None, cu_seqlens_cpu=None)
    cu = torch.zeros(fb.batch_size + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0)
    return FLAMetadata(decode=False, cu_seqlens=cu.to(fb.input_ids.device), cu_seqlens_cpu=cu)
