"""Pooling the final hidden states: per chunk in the runner, per request in the engine.

A pooling request's prompt may run in several chunks (chunked prefill). Each chunk's rows give a
small contribution, computed by the runner right after the forward (`pool_chunks`, on the device):
MEAN the sum of the chunk's rows (float32), CLS the first prompt row (the chunk that starts at 0),
LAST the last prompt row (the chunk that ends the prompt). The engine adds them up per request
(`PoolingState`) and, after the last prompt chunk, turns them into the embedding: the mean, then the
Matryoshka truncation, then L2 normalization, as vLLM's embedding pooler does. An image split across
chunks needs nothing more: each chunk's rows already hold their slice of its embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from vlmrun.pooling.params import ResolvedPooling


@dataclass(frozen=True)
class ChunkPooling:
    """What the runner computes from one pooling chunk's rows (`ChunkInput.pooling`)."""

    pooling_type: str  # LAST | MEAN | CLS
    first: bool  # the chunk starts at prompt position 0
    last: bool  # the chunk ends the prompt

    @property
    def contributes(self) -> bool:
        return self.pooling_type == "MEAN" or (self.first if self.pooling_type == "CLS" else self.last)


def pool_chunk_rows(rows: torch.Tensor, task: ChunkPooling) -> torch.Tensor:
    """rows [n, hidden] of one chunk -> its contribution [hidden] float32."""
    if task.pooling_type == "MEAN":
        return rows.float().sum(dim=0)
    return (rows[0] if task.pooling_type == "CLS" else rows[-1]).float()


def pool_chunks(hidden: torch.Tensor, tasks: Sequence[Optional[ChunkPooling]],
                num_tokens: Sequence[int]) -> list[Optional[torch.Tensor]]:
    """hidden [step tokens, hidden] (each chunk's rows in turn, `num_tokens` per chunk) -> per chunk its
    contribution [hidden] (float32, on hidden's device) or None (not pooling, or nothing from this chunk)."""
    out: list[Optional[torch.Tensor]] = []
    offset = 0
    for task, n in zip(tasks, num_tokens):
        out.append(pool_chunk_rows(hidden[offset:offset + n], task) if task is not None and task.contributes else None)
        offset += n
    return out


def finish_embedding(pooled: torch.Tensor, pooling: ResolvedPooling) -> torch.Tensor:
    """The pooled vector [hidden] -> the embedding: truncated to `dimensions`, then L2-normalized if asked."""
    if pooling.dimensions is not None:
        pooled = pooled[:pooling.dimensions]
    if pooling.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled


@dataclass
class PoolingState:
    """One pooling request's accumulator, kept by the engine (`Request.pooling`)."""

    pooling: ResolvedPooling
    total: Optional[torch.Tensor] = field(default=None, repr=False)  # [hidden] float32, host

    def chunk(self, start: int, end: int, num_prompt_tokens: int) -> ChunkPooling:
        """The runner's task for the chunk feeding prompt positions [start, end)."""
        return ChunkPooling(self.pooling.pooling_type, first=start == 0, last=end >= num_prompt_tokens)

    def add(self, start: int, end: int, num_prompt_tokens: int,
            contribution: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The runner's output for the chunk [start, end) of a `num_prompt_tokens` prompt; the embedding
        [dim] float32 once the prompt is done, else None. A chunk from position 0 starts over (a request
        recomputing after preemption)."""
        if start == 0:
            self.total = None
        if contribution is not None:
            self.total = contribution if self.total is None else self.total + contribution
        if end < num_prompt_tokens:
            return None
        pooled = self.total
        if self.pooling.pooling_type == "MEAN":
            pooled = pooled / num_prompt_tokens
        return finish_embedding(pooled, self.pooling)


def pooled_to_host(pooled: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    """The runner's per-chunk contributions on the host (float32), in one transfer; [] for []."""
    present = [p for p in pooled if p is not None]
    if not present:
        return [None] * len(pooled)
    host = iter(torch.stack(present).cpu().unbind(0))
    return [None if p is None else next(host) for p in pooled]
