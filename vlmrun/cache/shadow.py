"""The scheduler's stand-ins for pools that live in other processes (tensor-parallel ranks).

Under tensor parallelism the KV pool, the page table and the GDN state pools live in every rank's
process, each rank holding its share of the heads. The scheduler in the driver keeps the same
bookkeeping as with local pools (free rows, pages, snapshot ids: the parts that are plain Python)
through these stand-ins, and every write they would make to device state — page-table rows,
zeroed GDN slots, GDN snapshots saved and restored — is recorded as a `CacheOp` in a `CacheOpLog`.
The executor sends the ops with the next step; each rank replays them, in order, on its own pools
(`replay_cache_ops`) before running the step, which is the order the local engine makes them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrun.cache.gdn_pool import GDNSnapshotPool
from vlmrun.cache.kv_pool import PageAllocator, ReqToTokenPool
from vlmrun.cache.plan import CachePlan, Caches
from vlmrun.config import CacheShape


@dataclass(frozen=True)
class CacheOp:
    """`caches.<pool>.<method>(*args)`, to be run on a rank's own pools."""
    pool: str
    method: str
    args: tuple


@dataclass
class CacheOpLog:
    ops: list[CacheOp] = field(default_factory=list)

    def record(self, pool: str, method: str, *args: Any) -> None:
        self.ops.append(CacheOp(pool, method, args))

    def drain(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops


def replay_cache_ops(caches: Caches, ops: list[CacheOp]) -> None:
    for op in ops:
        getattr(getattr(caches, op.pool), op.method)(*op.args)


class ShadowReqToTokenPool(ReqToTokenPool):
    """Rows handed out as by `ReqToTokenPool`; the table itself lives in the ranks."""

    def __init__(self, max_reqs: int, log: CacheOpLog):  # no table here: the bookkeeping only
        self.free_rows = list(range(max_reqs))
        self.max_reqs = max_reqs
        self.log = log

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.log.record("req_to_token", "write", rows, positions, slots)


class ShadowGDNPool:
    """The GDN state pool's size; zeroing a slot is recorded."""

    def __init__(self, num_layers: int, num_slots: int, log: CacheOpLog):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.log = log

    def zero(self, slots: torch.Tensor) -> None:
        self.log.record("gdn_pool", "zero", slots)


class ShadowSnapshotPool(GDNSnapshotPool):
    """Snapshot ids handed out as by `GDNSnapshotPool`; saving and restoring states is recorded."""

    def __init__(self, num_snapshots: int, log: CacheOpLog):  # no state here: the bookkeeping only
        self.num_snapshots = num_snapshots
        self.free_ids = list(range(num_snapshots - 1, -1, -1))
        self.log = log

    def save(self, slot: int, idx: int) -> None:
        self.log.record("gdn_snapshots", "save", slot, idx)

    def restore(self, idx: int, slot: int) -> None:
        self.log.record("gdn_snapshots", "restore", idx, slot)


def build_shadow_caches(shape: CacheShape, plan: CachePlan) -> tuple[Caches, CacheOpLog]:
    """The driver's `Caches` for `plan` (every rank's plan) and the log its writes go to. No KV pool."""
    log = CacheOpLog()
    caches = Caches(plan=plan, kv_pool=None, req_to_token=ShadowReqToTokenPool(plan.max_num_seqs, log),
                    allocator=PageAllocator(plan.num_pages, plan.page_size))
    if shape.is_hybrid:
        caches.gdn_pool = ShadowGDNPool(shape.num_linear_layers, plan.num_gdn_slots, log)
        if plan.num_gdn_snapshots:
            caches.gdn_snapshots = ShadowSnapshotPool(plan.num_gdn_snapshots, log)
    return caches, log
