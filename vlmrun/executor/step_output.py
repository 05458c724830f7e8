"""What a step gives back, per chunk (`ChunkOutput`, `SampledToken`) and for its decode rows
(`DecodedRows`): the records every executor returns (`executor/base.py`'s interface), apart from any
implementation of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SampledToken:
    token_id: int
    logprobs: Optional[dict[int, float]]


@dataclass
class ChunkOutput:
    """What one chunk of a step produced."""

    sampled: Optional[SampledToken] = None  # None: the chunk ends mid-prompt
    # with prompt logprobs: {token id: raw logprob} of positions start + 1 .. start + m (next prompt token + top-k)
    prompt_logprobs: Optional[list[dict[int, float]]] = None
    # speculative decoding: the token sampled after each accepted draft (so one per accepted draft);
    # the request's new tokens are `sampled`, then these
    after_drafts: list[SampledToken] = field(default_factory=list)
    pooled: Optional[torch.Tensor] = None  # a pooling chunk's contribution [hidden] float32 (vlmrun/pooling/pooler.py)


@dataclass
class DecodedRows:
    """What a step's decode rows (`DecodeRows`) sampled, row by row, as the host reads them."""

    token_ids: list[int]
    logprobs: list[Optional[dict[int, float]]]  # None where a row asked for none
