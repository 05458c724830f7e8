"""Tensor parallelism: which rank of how many this process is, and the collectives layers call.

`TensorParallel(rank, size)` is handed explicitly to a model's constructor and from there to its
blocks and layers; nothing reads it from a global. With `size == 1` (the default, `SINGLE`) every
collective is the identity and every shard is the whole tensor, so a model built without it is
exactly the one-device model. With `size > 1` the collectives run on torch.distributed's default
process group, which the executor (`vlmrun/executor/distributed.py`) sets up in each rank's
process before the model is built.

Sharding rules the layers share: a dimension of `n` rows splits into `size` equal contiguous parts
(`split`); attention heads split the same way, except that when there are fewer heads than ranks
(KV heads of a GQA model) each head is replicated over `size // heads` consecutive ranks (`heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    """This rank's rows of a dimension of `total` rows: `[start, start + length)`."""
    total: int
    start: int
    length: int


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE: whole experts split across the ranks instead of every expert sliced

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of {self.size} is not a valid rank")

    # ------------------------------------------------------------------ shards

    def split(self, total: int, what: str = "rows") -> Shard:
        """An even split of `total` rows (raises naming `what` when they do not divide)."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the {total} {what}")
        length = total // self.size
        return Shard(total, self.rank * length, length)

    def heads(self, num_heads: int, head_dim: int, what: str = "heads", replicate: bool = False) -> Shard:
        """This rank's heads as rows of `head_dim`: split evenly, or (`replicate`, KV heads) each head
        replicated over `size // num_heads` ranks when there are fewer heads than ranks."""
        if num_heads % self.size and not (replicate and self.size % num_heads == 0):
            raise ValueError(f"tensor_parallel_size={self.size} must divide the {num_heads} {what}"
                             + (" or be a multiple of them" if replicate else ""))
        per_rank = max(num_heads // self.size, 1)
        first = self.rank * num_heads // self.size
        return Shard(num_heads * head_dim, first * head_dim, per_rank * head_dim)

    def num_heads(self, num_heads: int) -> int:
        """How many of `num_heads` heads this rank holds (at least one: see `heads`)."""
        return max(num_heads // self.size, 1)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place; `x` itself when there is one rank)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; `x` itself when there is one rank)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=0)
        return x

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., d] concatenated along the last dim -> [..., size * d]."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()  # one device: no sharding, no communication
