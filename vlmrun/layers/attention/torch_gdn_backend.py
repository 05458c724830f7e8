"""The reference Gated DeltaNet backend: torch ops over the GDN state pool, any device.

`forward` serves the `GDNAttention` layers of a hybrid model. For each sequence of the
ragged batch it reads the sequence's slot (`fb.state_slots`), runs the causal conv1d from the
slot's conv state and the gated delta rule from the slot's recurrent state, and writes both
states back:
  - sequences feeding several tokens (prefills or prefill chunks) run `chunk_gated_delta_rule`
    together when they feed the same number of tokens (one batched call per length: a batch of
    same-size images prefills at once), each from its own slot's state; a later chunk starts from
    the state the previous chunk left;
  - all sequences feeding one token (decodes) run together as one `recurrent_gated_delta_rule`
    step, gathered and scattered by slot;
  - sequences with draft tokens (speculative decoding's verify pass, `fb.num_drafts_cpu`) get the
    values that many decode steps would give (the conv over all positions at once, each from the
    window a decode step would see; the delta rule token by token, `recurrent_gated_delta_rule_states`,
    the state rounded to the pool's dtype after each), together when they feed the same number of
    tokens; the states after every position are kept on the metadata (`VerifyGroup`) and
    `keep_accepted_states` writes the ones after the accepted positions into the slots, so the slot
    holds what plain decode of the accepted tokens leaves. (Memory: per GDN layer and such sequence,
    1 + k conv and recurrent states, for the length of the step.) A verify step padded to a bucket
    (executor/bucketed_steps.py: every sequence feeds the same number of tokens, in order) reads
    `fb.state_slots` as they are, so the step can be captured in a CUDA graph.
The per-step split is computed once in `prepare` from host lists (no device→host sync) and kept
on `fb.gdn_metadata`, so a flash-linear-attention backend can take the same seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union, cast

import torch
import torch.nn.functional as F

from vlmrun.cache.gdn_pool import GDNPool
from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload
from vlmrun.layers.attention.base import GDNAttention, GDNBackend
from vlmrun.layers.gdn_ops import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_states,
    split_gdn_heads,
)

@dataclass
class ExtendGroup:
    """Sequences feeding the same number (> 1) of tokens this step, run as one batch."""

    length: int
    slots: torch.Tensor  # [n] the sequences' GDN slots
    rows: torch.Tensor  # [n * length] their rows in the token stream, sequence by sequence


@dataclass
class VerifyGroup:
    """Sequences with draft tokens feeding the same number of tokens, and the states after each position."""

    length: int
    slots: torch.Tensor  # [n] the sequences' GDN slots
    rows: Optional[torch.Tensor]  # [n * length] their rows in the token stream, sequence by sequence; None: all
    batch_index: torch.Tensor  # [n] the sequences' places in the step's batch, on the device
    conv_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, length, conv_dim, K-1]
    recurrent_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, length, Hv, Dv, Dk]


@dataclass
class GDNMetadata:
    extends: list[ExtendGroup]  # sequences feeding more than one token, grouped by length
    decode_rows: Optional[torch.Tensor]  # [n_decode] token rows of one-token sequences (None in a DECODE step)
    decode_slots: Optional[torch.Tensor]  # [n_decode] their GDN slots; None when no sequence feeds one token
    decode_is_whole_batch: bool  # a DECODE step: every sequence feeds one token, rows are the stream in order
    verifies: list[VerifyGroup] = field(default_factory=list)  # sequences with draft tokens, grouped by length


class TorchGDNBackend(GDNBackend):
    """GDN layers in torch ops; full attention belongs to the backend beside it."""

    verifies_drafts = True

    def __init__(self, pool: GDNPool):
        self.pool = pool

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.state_slots is None:
            raise ValueError("a hybrid model's ForwardBatch needs state_slots (the GDN slot of each sequence)")
        by_length: dict[int, list[tuple[int, int]]] = {}  # length -> (batch index, first row)
        verify_by_length: dict[int, list[tuple[int, int]]] = {}  # the same, for sequences with drafts
        decode_batch: list[int] = []
        decode_rows: list[int] = []
        start = 0
        for i, n in enumerate(fb.extend_seq_lens_cpu):
            if fb.num_drafts_cpu is not None and fb.num_drafts_cpu[i]:
                verify_by_length.setdefault(n, []).append((i, start))
            elif n == 1:
                decode_batch.append(i)
                decode_rows.append(start)
            else:
                by_length.setdefault(n, []).append((i, start))
            start += n
        device = fb.state_slots.device

        def slots_and_rows(n: int, seqs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            slots = fb.state_slots.index_select(0, upload(torch.tensor([i for i, _ in seqs]), device))
            return slots, upload((torch.tensor([s for _, s in seqs])[:, None] + torch.arange(n)).flatten(), device)

        extends = [ExtendGroup(n, *slots_and_rows(n, seqs)) for n, seqs in by_length.items()]
        if len(verify_by_length) == 1 and len(next(iter(verify_by_length.values()))) == fb.batch_size:
            n = next(iter(verify_by_length))  # every sequence verifies n tokens (a padded verify step)
            verifies = [VerifyGroup(n, fb.state_slots, None, torch.arange(fb.batch_size, device=device))]
        else:
            verifies = [VerifyGroup(n, *slots_and_rows(n, seqs), upload(torch.tensor([i for i, _ in seqs]), device))
                        for n, seqs in verify_by_length.items()]
        whole = len(decode_batch) == fb.batch_size  # a DECODE step
        rows = slots = None
        if decode_batch and whole:
            slots = fb.state_slots
        elif decode_batch:
            rows = upload(torch.tensor(decode_rows, dtype=torch.int64), device)
            slots = fb.state_slots[upload(torch.tensor(decode_batch, dtype=torch.int64), device)]
        fb.gdn_metadata = GDNMetadata(extends, rows, slots, bool(decode_batch) and whole, verifies)

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: GDNAttention, fb: ForwardBatch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], g [T, Hv] float32, beta [T, Hv], conv_weight [conv_dim, K] -> [T, Hv, Dv]."""
        md = cast(GDNMetadata, fb.gdn_metadata)
        conv_state = self.pool.conv_state[layer.layer_id]  # [slots, conv_dim, K-1]
        rec_state = self.pool.recurrent_state[layer.layer_id]  # [slots, Hv, Dv, Dk]
        if md.decode_is_whole_batch:
            return self._decode(mixed_qkv, g, beta, conv_weight, md.decode_slots, layer, conv_state, rec_state)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)  # [T, Hv, Dv]

        for group in md.extends:
            slots, length = group.slots, group.length
            n = slots.shape[0]
            x = mixed_qkv.index_select(0, group.rows).view(n, length, -1)  # [n, length, conv_dim]
            y, new_conv = causal_conv1d(x, conv_weight, conv_state.index_select(0, slots))
            q, k, v = split_gdn_heads(y.flatten(0, 1), layer)  # [n * length, H, D] each
            o, new_rec = chunk_gated_delta_rule(
                q.view(n, length, *q.shape[1:]), k.view(n, length, *k.shape[1:]), v.view(n, length, *v.shape[1:]),
                g.index_select(0, group.rows).view(n, length, -1), beta.index_select(0, group.rows).view(n, length, -1),
                rec_state.index_select(0, slots))
            conv_state[slots] = new_conv.to(conv_state.dtype)
            rec_state[slots] = new_rec.to(rec_state.dtype)
            out[group.rows] = o.flatten(0, 1)

        for verify in md.verifies:
            if verify.rows is None:  # every sequence of the step
                return self._verify(mixed_qkv, g, beta, conv_weight, verify, layer, conv_state, rec_state)
            out[verify.rows] = self._verify(mixed_qkv.index_select(0, verify.rows), g.index_select(0, verify.rows),
                                            beta.index_select(0, verify.rows), conv_weight, verify, layer, conv_state,
                                            rec_state)

        if md.decode_slots is not None:
            rows = md.decode_rows
            out[rows] = self._decode(mixed_qkv.index_select(0, rows), g.index_select(0, rows),
                                     beta.index_select(0, rows), conv_weight, md.decode_slots, layer, conv_state,
                                     rec_state)
        return out

    def _decode(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                slots: torch.Tensor, layer: GDNAttention, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        """One token for each of n sequences: x [n, conv_dim], g/beta [n, Hv] -> [n, Hv, Dv]."""
        y, new_conv = causal_conv1d_step(x, conv_weight, conv_state.index_select(0, slots))
        q, k, v = split_gdn_heads(y, layer)  # [n, H, D] each
        o, new_rec = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                rec_state.index_select(0, slots))
        conv_state[slots] = new_conv.to(conv_state.dtype)
        rec_state[slots] = new_rec.to(rec_state.dtype)
        return o[:, 0]

    def _verify(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                group: VerifyGroup, layer: GDNAttention, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        """n sequences of `group.length` tokens, with the values `group.length` decode steps would give:
        x [n * L, conv_dim], g/beta [n * L, Hv] -> [n * L, Hv, Dv]; keeps the states after every
        position on `group`. The conv runs over all positions at once (the window of position t: the
        inputs before it as the conv state holds them, then its own); the delta rule token by token."""
        n, length = group.slots.shape[0], group.length
        x, g, beta = x.view(n, length, -1), g.view(n, length, -1), beta.view(n, length, -1)
        carried = conv_state.index_select(0, group.slots)  # [n, C, K-1]
        history = torch.cat([carried, x.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [n, C, K-1 + L]
        kept = carried.shape[2]
        before = history[..., :-1].unfold(2, kept, 1)  # [n, C, L, K-1]: the conv state before each position
        windows = torch.cat([before.to(x.dtype), x.transpose(1, 2).unsqueeze(-1)], dim=-1)  # [n, C, L, K]
        y = F.silu((windows.to(conv_weight.dtype) * conv_weight[:, None, :]).sum(dim=-1)).to(x.dtype)  # [n, C, L]
        q, k, v = split_gdn_heads(y.transpose(1, 2).reshape(n * length, -1), layer)  # [n * L, H, D] each
        o, states = recurrent_gated_delta_rule_states(
            q.view(n, length, *q.shape[1:]), k.view(n, length, *k.shape[1:]), v.view(n, length, *v.shape[1:]),
            g, beta, rec_state.index_select(0, group.slots), rec_state.dtype)
        convs = history[..., 1:].unfold(2, kept, 1).transpose(1, 2)  # [n, L, C, K-1]: after each position
        group.conv_states[layer.layer_id] = convs
        group.recurrent_states[layer.layer_id] = states  # [n, L, Hv, Dv, Dk]
        conv_state[group.slots] = convs[:, -1]
        rec_state[group.slots] = states[:, -1]
        return o.flatten(0, 1)  # [n * L, Hv, Dv]

    def keep_accepted_states(self, metadata: GDNMetadata, num_accepted: Union[list[int], torch.Tensor]) -> None:
        """Slot of each verified sequence <- its states after position num_accepted[i] (its last known
        token is position 0, each accepted draft one more; a device tensor is read without a sync).
        Sequences past the end of `num_accepted` (a padded step's padding rows) keep position 0."""
        if not metadata.verifies:
            return
        device = metadata.verifies[0].slots.device
        accepted = num_accepted if isinstance(num_accepted, torch.Tensor) else upload(torch.tensor(num_accepted), device)
        for group in metadata.verifies:
            n = group.slots.shape[0]
            padded = torch.nn.functional.pad(accepted, (0, max(0, n - accepted.shape[0])))  # [>= batch]
            positions = padded[group.batch_index]  # [n]
            seqs = torch.arange(n, device=device)
            for layer_id, states in group.conv_states.items():
                self.pool.conv_state[layer_id][group.slots] = states[seqs, positions]
            for layer_id, states in group.recurrent_states.items():
                self.pool.recurrent_state[layer_id][group.slots] = states[seqs, positions]
