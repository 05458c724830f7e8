"""The per-step record that models, layers, attention backends and the vision stage read.

This module sits on the bottom floor: it imports nothing from vlmrun, so every layer can import it.
A `ForwardBatch` describes one forward pass over a ragged batch: each sequence feeds
`extend_seq_lens[i]` new tokens on top of `extend_prefix_lens[i]` tokens already in the KV cache.
A decode is an extend of one token. Chunked-prefill chunks and decodes can share one batch.

It carries the step's attention backend, typed by what the attention layers call on it
(`AttentionForward`, `LinearAttentionForward`); `AttentionBackend` and `LinearAttentionBackend`
in `vlmrun/layers/attention/base.py`, a floor above, are the full interfaces and implement these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Optional, Protocol

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # at least one sequence feeds more than one token (prefill or a prefill chunk)
    DECODE = auto()  # every sequence feeds exactly one token


class LinearAttentionForward(Protocol):
    """The call a `LinearAttention` (GDN) layer makes on the linear-attention backend of the step.

    `layer` is the calling layer (`vlmrun.layers.attention.LinearAttention`, a floor above this one).
    """

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: Any, fb: ForwardBatch) -> torch.Tensor: ...


class AttentionForward(Protocol):
    """What the attention layers reach through `ForwardBatch.attn_backend`: `forward`, called by a
    full-attention layer (`vlmrun.layers.attention.Attention`, passed as `layer`), and `linear`, the
    backend of the GDN layers (None for a model without them)."""

    @property
    def linear(self) -> Optional[LinearAttentionForward]: ...

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
    # The attention backend of this step (a HybridAttnBackend for hybrid models, whose `linear` serves the
    # GDN layers) and the metadata its `prepare` built: full attention's, and the GDN layers' for hybrid
    # models. The metadata is opaque here: only the backend that built it reads it (as its own type).
    attn_backend: Optional[AttentionForward] = None
    attn_metadata: object = None
    linear_attn_metadata: object = None
    # Multimodal splice: embeddings for the rows of input_ids where mm_mask is True, in row order.
    mm_mask: Optional[torch.Tensor] = None  # [num_tokens] bool
    mm_embeds: Optional[torch.Tensor] = None  # [num_mm_tokens, hidden]
    # Qwen3-VL DeepStack: features added to the mm rows after each of the first decoder layers.
    deepstack_embeds: Optional[torch.Tensor] = None  # [num_deepstack_layers, num_mm_tokens, hidden]
    # Hybrid models: the GDN state-pool slot of each sequence (slot 0 is the dummy for padding rows).
    state_slots: Optional[torch.Tensor] = None  # [batch] int64
    # Speculative decoding: per sequence, how many of its fed tokens (the last ones) are drafts; None
    # when no sequence has any. A GDN backend keeps the state after each position of such a sequence.
    num_drafts_cpu: Optional[list[int]] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
