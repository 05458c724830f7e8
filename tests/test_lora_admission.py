"""LoRA admission in the scheduler: a request waiting for an adapter slot holds back no base-model request
behind it (no head-of-line blocking), and no adapter request behind it takes the slots from it (no starvation)."""

from __future__ import annotations

import torch

from vlmrun.cache.plan import build_pools, plan_cache_memory
from vlmrun.config import CacheShape, EngineConfig
from vlmrun.engine.request import Request, RequestStatus
from vlmrun.engine.scheduler import Scheduler
from vlmrun.lora.request import LoRARequest
from vlmrun.processors import ProcessedPrompt
from vlmrun.sampling_params import SamplingParams

ADAPTER_A = LoRARequest("a", 1, "/nowhere/a")
ADAPTER_B = LoRARequest("b", 2, "/nowhere/b")


def scheduler(max_loras: int = 1) -> Scheduler:
    shape = CacheShape(num_attention_layers=1, num_kv_heads=1, head_dim=4)
    plan = plan_cache_memory(shape, 1 << 20, dtype=torch.float32, gdn_state_dtype=torch.float32, max_num_seqs=8,
                             max_model_len=64, page_size=4, max_model_len_fixed=True, gdn_snapshots=0)
    caches = build_pools(shape, plan, EngineConfig(), dtype=torch.float32, device=torch.device("cpu"))
    return Scheduler(caches, max_num_batched_tokens=256, max_loras=max_loras)


def request(name: str, lora: LoRARequest | None) -> Request:
    ids = [1, 2, 3, 4, 5]
    positions = torch.arange(len(ids), dtype=torch.int64).expand(3, -1)
    return Request(request_id=name, prompt=ProcessedPrompt(ids), sampling_params=SamplingParams(max_tokens=4),
                   mrope_positions=positions, mrope_delta=0, eos_token_ids=[0], lora=lora)


def admitted(sched: Scheduler) -> list[str]:
    chunks, _, too_long = sched.schedule()
    assert not too_long
    return [c.request.request_id for c in chunks if c.admitted]


def test_base_request_is_not_blocked_by_one_waiting_for_a_slot():
    sched = scheduler(max_loras=1)
    sched.add(request("a1", ADAPTER_A))
    assert admitted(sched) == ["a1"]  # adapter a holds the one slot
    sched.add(request("b1", ADAPTER_B))  # waits for the slot
    sched.add(request("base", None))  # needs no slot: runs now
    assert admitted(sched) == ["base"]
    assert [r.request_id for r in sched.waiting] == ["b1"]


def test_the_skipped_request_is_not_starved_by_later_requests_of_the_running_adapter():
    sched = scheduler(max_loras=1)
    a1 = request("a1", ADAPTER_A)
    sched.add(a1)
    assert admitted(sched) == ["a1"]
    sched.add(request("b1", ADAPTER_B))
    sched.add(request("a2", ADAPTER_A))  # fits a's slot, but would keep it from b1: waits behind b1
    sched.add(request("base", None))
    assert admitted(sched) == ["base"]
    assert [r.request_id for r in sched.waiting] == ["b1", "a2"]
    sched.finish(a1)  # a's slot frees: b1, first in line, takes it; a2 waits for it in turn
    assert admitted(sched) == ["b1"]
    assert [r.request_id for r in sched.waiting] == ["a2"]
    assert sched.running[-1].status is RequestStatus.RUNNING
