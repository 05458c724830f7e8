"""The scheduler's stand-ins for pools that live in other processes (tensor-parallel ranks).

Under tensor parallelism the KV pool, the page table and the GDN state pools live in every rank's
process, each rank holding its share of the heads. The scheduler in the driver keeps the same
bookkeeping as with local pools (free rows, pages, snapshot ids: the parts that are plain Python)
through these stand-ins. Each implements the interface its real pool implements (`PageTable`,
`GDNSlots`, `GDNSnapshots`: the bookkeeping is theirs, the writes are abstract), and records every
write the real pool would make to device state — page-table rows, zeroed GDN slots, GDN snapshots
saved and restored — as a typed `CacheOp` in a `CacheOpLog`. The executor sends the ops with the
next step; each rank replays them, in order, on its own pools (`replay_cache_ops`) before running
the step, which is the order the local engine makes them in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from vlmrun.cache.gdn_pool import GDNSlots, GDNSnapshots
from vlmrun.cache.kv_pool import PageAllocator, PageTable
from vlmrun.cache.plan import CachePlan, Caches
from vlmrun.config import CacheShape

# ------------------------------------------------------------------ the recorded writes


class CacheOp(ABC):
    """One write to a rank's pools, recorded in the driver."""

    @abstractmethod
    def apply(self, caches: Caches) -> None:
        """Make the write on `caches` (a rank's own pools)."""


@dataclass(frozen=True)
class WritePageTable(CacheOp):
    """`PageTable.write(rows, positions, slots)`."""
    rows: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64

    def apply(self, caches: Caches) -> None:
        caches.req_to_token.write(self.rows, self.positions, self.slots)


@dataclass(frozen=True)
class ZeroGDNSlots(CacheOp):
    """`GDNSlots.zero(slots)`."""
    slots: torch.Tensor  # [n] int64

    def apply(self, caches: Caches) -> None:
        assert caches.gdn_pool is not None, "the driver's plan has GDN slots, so every rank's has"
        caches.gdn_pool.zero(self.slots)


@dataclass(frozen=True)
class SaveSnapshot(CacheOp):
    """`GDNSnapshots.save(slot, idx)`."""
    slot: int
    idx: int

    def apply(self, caches: Caches) -> None:
        assert caches.gdn_snapshots is not None, "the driver's plan has GDN snapshots, so every rank's has"
        caches.gdn_snapshots.save(self.slot, self.idx)


@dataclass(frozen=True)
class RestoreSnapshot(CacheOp):
    """`GDNSnapshots.restore(idx, slot)`."""
    idx: int
    slot: int

    def apply(self, caches: Caches) -> None:
        assert caches.gdn_snapshots is not None, "the driver's plan has GDN snapshots, so every rank's has"
        caches.gdn_snapshots.restore(self.idx, self.slot)


@dataclass
class CacheOpLog:
    ops: list[CacheOp] = field(default_factory=list)

    def record(self, op: CacheOp) -> None:
        self.ops.append(op)

    def drain(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops


def replay_cache_ops(caches: Caches, ops: list[CacheOp]) -> None:
    for op in ops:
        op.apply(caches)


# ------------------------------------------------------------------ the stand-ins


class ShadowReqToTokenPool(PageTable):
    """Rows handed out as by `ReqToTokenPool`; the table itself lives in the ranks."""

    def __init__(self, max_reqs: int, log: CacheOpLog):
        super().__init__(max_reqs)
        self.log = log

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.log.record(WritePageTable(rows, positions, slots))


class ShadowGDNPool(GDNSlots):
    """The size of `GDNPool`; the states live in the ranks."""

    def __init__(self, num_layers: int, num_slots: int, log: CacheOpLog):
        super().__init__(num_layers, num_slots)
        self.log = log

    def zero(self, slots: torch.Tensor) -> None:
        self.log.record(ZeroGDNSlots(slots))


class ShadowSnapshotPool(GDNSnapshots):
    """Snapshot ids handed out as by `GDNSnapshotPool`; the snapshots live in the ranks."""

    def __init__(self, num_snapshots: int, log: CacheOpLog):
        super().__init__(num_snapshots)
        self.log = log

    def save(self, slot: int, idx: int) -> None:
        self.log.record(SaveSnapshot(slot, idx))

    def restore(self, idx: int, slot: int) -> None:
        self.log.record(RestoreSnapshot(idx, slot))


def build_shadow_caches(shape: CacheShape, plan: CachePlan) -> tuple[Caches, CacheOpLog]:
    """The driver's `Caches` for `plan` (every rank's plan) and the log its writes go to.

    No KV pool, and stand-ins where the real bundle has device pools: the bundle is for a
    scheduler only, never for a runner.
    """
    log = CacheOpLog()
    caches = Caches(plan=plan, kv_pool=None, req_to_token=ShadowReqToTokenPool(plan.max_num_seqs, log),
                    allocator=PageAllocator(plan.num_pages, plan.page_size))
    if shape.is_hybrid:
        caches.gdn_pool = ShadowGDNPool(shape.num_gdn_layers, plan.num_gdn_slots, log)
        if plan.num_gdn_snapshots:
            caches.gdn_snapshots = ShadowSnapshotPool(plan.num_gdn_snapshots, log)
    return caches, log
