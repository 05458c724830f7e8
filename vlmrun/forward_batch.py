"""The per-step record that models, layers, attention backends and the vision stage read.

This module sits on the bottom floor: it imports nothing from vlmrun but `host_to_device` (its floor),
so every layer can import it.
A `ForwardBatch` describes one forward pass over a ragged batch: each sequence feeds
`extend_seq_lens[i]` new tokens on top of `extend_prefix_lens[i]` tokens already in the KV cache.
A decode is an extend of one token. Chunked-prefill chunks and decodes can share one batch.
`ForwardBatch.build` makes one from host values (the step's, `vlmrun/executor/step_batch.py`, MTP's
drafting steps and padded decode's, `vlmrun/executor/bucketed_steps.py`); `select` cuts one to some of its sequences (MTP's catch-up over the chunks that feed it).

It carries the step's attention backend, typed by what the attention layers call on it
(`AttentionForward`, `GDNForward`); `AttentionBackend` and `GDNBackend`
in `vlmrun/layers/attention/base.py`, a floor above, are the full interfaces and implement these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from operator import add
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from vlmrun.host_to_device import int64_tensor

# A fed token the host does not have yet: the one a launched step samples for that row (async scheduling,
# MTP drafts); the runner fills it in on the device. Here, on the bottom floor, so the scheduler, the
# proposers and the runner share it without importing each other.
PLACEHOLDER_TOKEN = -1

ToDevice = Callable[[torch.Tensor], torch.Tensor]  # a host tensor on the step's device (`vlmrun.host_to_device.upload`)


class ForwardMode(Enum):
    EXTEND = auto()  # at least one sequence feeds more than one token (prefill or a prefill chunk)
    DECODE = auto()  # every sequence feeds exactly one token


class GDNForward(Protocol):
    """The call a `GDNAttention` (GDN) layer makes on the GDN backend of the step.

    `layer` is the calling layer (`vlmrun.layers.attention.GDNAttention`, a floor above this one).
    """

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: Any, fb: ForwardBatch) -> torch.Tensor: ...


class AttentionForward(Protocol):
    """What the attention layers reach through `ForwardBatch.attn_backend`: `forward`, called by a
    full-attention layer (`vlmrun.layers.attention.Attention`, passed as `layer`), and `gdn`, the
    backend of the GDN layers (None for a model without them)."""

    @property
    def gdn(self) -> Optional[GDNForward]: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                fb: ForwardBatch) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [3, num_tokens] int64: M-RoPE rows (t, h, w); 1-D RoPE models read row 0
    req_pool_indices: torch.Tensor  # [batch] int64, rows of ReqToTokenPool
    seq_lens: torch.Tensor  # [batch] int64, cached tokens after this step (prefix + extend)
    extend_prefix_lens: torch.Tensor  # [batch] int64, tokens already cached before this step
    extend_seq_lens: torch.Tensor  # [batch] int64, tokens fed this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each fed token writes
    # Host copies of the per-sequence lengths, so backends never sync to read them.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # Rows of the token stream whose logits are wanted (the last fed token of sequences that sample).
    logits_indices: torch.Tensor  # [num_sampled] int64
    # The attention backend of this step (a HybridAttnBackend for hybrid models, whose `gdn` serves the
    # GDN layers) and the metadata its `prepare` built: full attention's, and the GDN layers' for hybrid
    # models. The metadata is opaque here: only the backend that built it reads it (as its own type).
    attn_backend: Optional[AttentionForward] = None
    attn_metadata: object = None
    gdn_metadata: object = None
    # Multimodal splice: embeddings for the rows of input_ids where mm_mask is True, in row order.
    mm_mask: Optional[torch.Tensor] = None  # [num_tokens] bool
    mm_embeds: Optional[torch.Tensor] = None  # [num_mm_tokens, hidden]
    # The model's own extras of those rows, by name (`Model.mm_extras`; Qwen3-VL: DeepStack features), each
    # [..., num_mm_tokens, d]; only the model that named them reads them.
    mm_extras: Optional[dict[str, torch.Tensor]] = None
    # Hybrid models: the GDN state-pool slot of each sequence (slot 0 is the dummy for padding rows).
    state_slots: Optional[torch.Tensor] = None  # [batch] int64
    # Speculative decoding: per sequence, how many of its fed tokens (the last ones) are drafts; None
    # when no sequence has any. A GDN backend keeps the state after each position of such a sequence.
    num_drafts_cpu: Optional[list[int]] = None
    # A verify step padded to a width per row (executor/bucketed_steps.py): per row, how many of its fed
    # tokens are real (the first ones; the rest write the dummy page). None: every fed token is real.
    real_fed_lens_cpu: Optional[list[int]] = None

    @classmethod
    def build(cls, *, input_ids: torch.Tensor, positions: torch.Tensor, req_pool_indices: torch.Tensor,
              extend_prefix_lens: list[int], extend_seq_lens: list[int], out_cache_loc: torch.Tensor,
              logits_indices: torch.Tensor, to_device: ToDevice, attn_backend: Optional[AttentionForward] = None,
              state_slots: Optional[torch.Tensor] = None,
              num_drafts: Optional[list[int]] = None,
              device_lens: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
              real_fed_lens: Optional[list[int]] = None) -> ForwardBatch:
        """The one way a step's batch is made from host values: host tensors go to the device with
        `to_device` (one already on a device stays), the sequence lengths are prefix + extend, the mode
        follows the extend lengths, `num_drafts` is kept only when a sequence has drafts. `device_lens`:
        (seq_lens, extend_prefix_lens, extend_seq_lens) [batch] already on the device with the host lists'
        values (a padded decode's static buffers, which its CUDA graph reads), taken as they are.
        `real_fed_lens`: a padded verify step's real tokens per row (`real_fed_lens_cpu`)."""
        seq_lens = list(map(add, extend_prefix_lens, extend_seq_lens))  # (no Python loop: a decode step's hundreds)

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return to_device(t) if t.device.type == "cpu" else t

        if device_lens is None:
            device_lens = (on_device(int64_tensor(seq_lens)), on_device(int64_tensor(extend_prefix_lens)),
                           on_device(int64_tensor(extend_seq_lens)))

        return cls(
            mode=ForwardMode.DECODE if len(extend_seq_lens) == input_ids.shape[0] else ForwardMode.EXTEND,
            input_ids=on_device(input_ids), positions=on_device(positions),
            req_pool_indices=on_device(req_pool_indices),
            seq_lens=device_lens[0], extend_prefix_lens=device_lens[1], extend_seq_lens=device_lens[2],
            out_cache_loc=on_device(out_cache_loc), seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=extend_prefix_lens, extend_seq_lens_cpu=extend_seq_lens,
            logits_indices=on_device(logits_indices), attn_backend=attn_backend,
            state_slots=None if state_slots is None else on_device(state_slots),
            num_drafts_cpu=num_drafts if num_drafts is not None and any(num_drafts) else None,
            real_fed_lens_cpu=real_fed_lens)

    def select(self, sequences: Sequence[int], token_rows: torch.Tensor, to_device: ToDevice) -> ForwardBatch:
        """This batch cut to some of its sequences (`sequences`, whose fed tokens are `token_rows` [n] of
        the token stream, on the device), unprepared, without logits rows nor GDN slots (the full-attention
        layers that run over a cut batch read none); the kept image rows follow."""
        at = to_device(torch.tensor(sequences, dtype=torch.int64))  # [sequences]
        extend_lens = [self.extend_seq_lens_cpu[i] for i in sequences]
        out = ForwardBatch(
            mode=ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND,
            input_ids=self.input_ids[token_rows], positions=self.positions[:, token_rows],
            req_pool_indices=self.req_pool_indices[at], seq_lens=self.seq_lens[at],
            extend_prefix_lens=self.extend_prefix_lens[at], extend_seq_lens=self.extend_seq_lens[at],
            out_cache_loc=self.out_cache_loc[token_rows], seq_lens_cpu=[self.seq_lens_cpu[i] for i in sequences],
            extend_prefix_lens_cpu=[self.extend_prefix_lens_cpu[i] for i in sequences], extend_seq_lens_cpu=extend_lens,
            logits_indices=self.logits_indices[:0], attn_backend=self.attn_backend)
        if self.num_drafts_cpu is not None and any(self.num_drafts_cpu[i] for i in sequences):
            out.num_drafts_cpu = [self.num_drafts_cpu[i] for i in sequences]
        if self.mm_mask is not None:  # the image rows of the kept tokens, in order
            kept = torch.zeros_like(self.mm_mask)
            kept[token_rows] = True
            out.mm_mask, out.mm_embeds = self.mm_mask[token_rows], self.mm_embeds[kept[self.mm_mask]]
        return out

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
