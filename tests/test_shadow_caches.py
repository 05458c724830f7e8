"""The tensor-parallel driver's stand-in pools (`vlmrun/cache/shadow.py`) against the real pools.

A stand-in must offer everything of the interface its real pool implements (the scheduler, the
engine and the prefix cache use that interface, whichever they hold), and the writes it records,
pickled and replayed on a rank's pools, must leave them as the same calls leave local pools.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from vlmrun.cache.gdn_pool import GDNPool, GDNSlots, GDNSnapshotPool, GDNSnapshots
from vlmrun.cache.kv_pool import PageTable, ReqToTokenPool
from vlmrun.cache.plan import Caches, build_pools, plan_cache_memory
from vlmrun.cache.shadow import (RestoreSnapshot, SaveSnapshot, WritePageTable, ZeroGDNSlots, build_shadow_caches,
                                 replay_cache_ops)
from vlmrun.config import CacheShape, EngineConfig

SHAPE = CacheShape(num_attention_layers=2, num_kv_heads=2, head_dim=8, num_gdn_layers=3, gdn_conv_dim=24,
                   gdn_conv_kernel=4, gdn_num_v_heads=2, gdn_head_v_dim=4, gdn_head_k_dim=4)
PAGE = 4


def make_plan():
    return plan_cache_memory(SHAPE, 1 << 20, dtype=torch.float32, gdn_state_dtype=torch.float32, max_num_seqs=3,
                             max_model_len=32, page_size=PAGE, max_model_len_fixed=True, gdn_snapshots=2)


def real_caches(plan) -> Caches:
    caches = build_pools(SHAPE, plan, EngineConfig(), dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)  # the states some steps would have left
    caches.gdn_pool.conv_state.copy_(torch.randn(caches.gdn_pool.conv_state.shape, generator=gen))
    caches.gdn_pool.recurrent_state.copy_(torch.randn(caches.gdn_pool.recurrent_state.shape, generator=gen))
    return caches


def interface_names(interface: type, *args) -> set[str]:
    """Public methods and attributes of `interface`, its constructor's included (built with its
    abstract methods stubbed)."""
    stubbed = type("Stubbed", (interface,), dict.fromkeys(interface.__abstractmethods__, lambda *a: None))
    return {name for name in dir(stubbed(*args)) if not name.startswith("_")}


@pytest.mark.parametrize("field,interface,real_cls,args", [
    ("req_to_token", PageTable, ReqToTokenPool, (3,)),
    ("gdn_pool", GDNSlots, GDNPool, (3, 4)),
    ("gdn_snapshots", GDNSnapshots, GDNSnapshotPool, (2,)),
])
def test_each_stand_in_offers_the_interface_of_its_real_pool(field, interface, real_cls, args):
    plan = make_plan()
    shadow, real = getattr(build_shadow_caches(SHAPE, plan)[0], field), getattr(real_caches(plan), field)
    assert isinstance(real, real_cls) and isinstance(shadow, interface) and not isinstance(shadow, real_cls)
    names = interface_names(interface, *args)
    assert names - set(dir(shadow)) == set(), f"{type(shadow).__name__} lacks part of {interface.__name__}"
    assert {name: getattr(shadow, name) for name in names if not callable(getattr(shadow, name))} == \
        {name: getattr(real, name) for name in names if not callable(getattr(real, name))}


def make_writes(caches: Caches) -> None:
    """What the scheduler and the prefix cache do to the caches over a few steps of a hybrid model."""
    rows = caches.req_to_token
    first, second = rows.alloc(), rows.alloc()
    rows.write(torch.tensor([first, first, second]), torch.tensor([0, 1, 0]), torch.tensor([5, 6, 9]))
    snapshot = caches.gdn_snapshots.alloc()
    caches.gdn_snapshots.save(first + 1, snapshot)  # GDN slot = row + 1
    caches.gdn_pool.zero(torch.tensor([first + 1, second + 1]))
    caches.gdn_snapshots.restore(snapshot, second + 1)
    rows.free(first)


def test_replayed_writes_match_the_local_ones():
    plan = make_plan()
    local, rank = real_caches(plan), real_caches(plan)
    shadow, log = build_shadow_caches(SHAPE, plan)
    make_writes(local)
    make_writes(shadow)
    ops = log.drain()
    assert [type(op) for op in ops] == [WritePageTable, SaveSnapshot, ZeroGDNSlots, RestoreSnapshot]
    assert log.drain() == []
    replay_cache_ops(rank, pickle.loads(pickle.dumps(ops)))  # as a step message carries them
    assert torch.equal(rank.req_to_token.req_to_token, local.req_to_token.req_to_token)
    assert torch.equal(rank.gdn_pool.conv_state, local.gdn_pool.conv_state)
    assert torch.equal(rank.gdn_pool.recurrent_state, local.gdn_pool.recurrent_state)
    assert torch.equal(rank.gdn_snapshots.recurrent, local.gdn_snapshots.recurrent)
    assert shadow.req_to_token.free_rows == local.req_to_token.free_rows
    assert shadow.gdn_snapshots.free_ids == local.gdn_snapshots.free_ids
    untouched = real_caches(plan)
    assert not torch.equal(rank.gdn_pool.recurrent_state, untouched.gdn_pool.recurrent_state), "the ops wrote"
