"""Priority scheduling (vLLM's `scheduling_policy="priority"`): lower `priority` first, ties by arrival,
the lowest-ranked running request preempted (for a running request's page and to admit a request ranked
before it); "fcfs" refuses a non-zero priority. Engine runs on the tiny Qwen3 checkpoint (float32, CPU)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from transformers import AutoConfig

from vlmrun import LLM, SamplingParams
from vlmrun.cache.plan import kv_bytes_per_token
from vlmrun.config import CacheShape, EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.engine.queue_policy import make_queue_policy
from vlmrun.sampling_params import SamplingParamError

PAGE = 4


def make_engine(model_dir, policy: str, pages: int = 64, **kw) -> Engine:
    """An engine whose KV pool holds `pages` usable pages of PAGE tokens (no prefix cache: no shared pages)."""
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    budget = pages * PAGE * kv_bytes_per_token(shape, torch.float32)
    options = dict(model=str(model_dir), dtype="float32", device="cpu", page_size=PAGE, max_model_len=128,
                   kv_cache_memory_bytes=budget, enable_prefix_caching=False, scheduling_policy=policy,
                   async_scheduling=False)
    return Engine(EngineConfig(**{**options, **kw}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt_of(engine: Engine, n: int, first: int = 100):
    return engine.process({"prompt_token_ids": [first + i for i in range(n)]})


def drain(engine: Engine, timeline: list[tuple[str, str]], tokens: Optional[dict[str, list[int]]] = None,
          steps: Optional[int] = None) -> dict[str, list[int]]:
    """Step until idle (or `steps` steps); `timeline` gets ("first", rid) / ("done", rid) / ("preempted", rid)
    in order, `tokens` each request's tokens."""
    tokens = {} if tokens is None else tokens
    preempted = {rid: req.num_preemptions for rid, req in engine.requests.items()}
    while engine.has_unfinished() and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        for update in engine.step():
            if update.new_token_ids and update.request_id not in tokens:
                timeline.append(("first", update.request_id))
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.result is not None:
                timeline.append(("done", update.request_id))
        for rid, req in engine.requests.items():
            if req.num_preemptions > preempted.get(rid, 0):
                preempted[rid] = req.num_preemptions
                timeline.append(("preempted", rid))
    return tokens


# ---------------------------------------------------------------------------- the policy object


def queued(priority: int, arrival: float):
    return SimpleNamespace(priority=priority, arrival_time=arrival)


def test_priority_queue_orders_by_priority_then_arrival():
    policy = make_queue_policy("priority")
    waiting: deque = deque()
    a, b, c, d = queued(5, 1.0), queued(0, 2.0), queued(0, 3.0), queued(-1, 4.0)
    for req in (a, b, c, d):
        policy.enqueue(waiting, req)
    assert list(waiting) == [d, b, c, a]
    early = queued(0, 0.5)  # preempted: back before later arrivals of its priority
    policy.requeue(waiting, early)
    assert list(waiting) == [d, early, b, c, a]
    running = [c, a, b]
    policy.order_running(running)
    assert running == [b, c, a]
    assert policy.admission_victim(running, d) is a
    assert policy.admission_victim(running, queued(5, 9.0)) is None, "never one ranked before the newcomer"
    assert policy.admission_victim([queued(0, 1.0)], queued(0, 2.0)) is None, "equals: the earlier arrival stays"


def test_fcfs_queue_is_arrival_order_and_refuses_a_priority():
    policy = make_queue_policy("fcfs")
    waiting: deque = deque()
    a, b = queued(0, 1.0), queued(0, 2.0)
    policy.enqueue(waiting, a)
    policy.enqueue(waiting, b)
    policy.requeue(waiting, queued(0, 3.0))
    assert [r.arrival_time for r in waiting] == [3.0, 1.0, 2.0]
    assert policy.admission_victim([a], b) is None
    policy.check(0)
    with pytest.raises(SamplingParamError, match="priority scheduling is not enabled") as err:
        policy.check(1)
    assert err.value.field == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_queue_policy("lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


# ---------------------------------------------------------------------------- the engine


def test_lower_priority_value_runs_first_ties_by_arrival(qwen3_dir):
    engine = make_engine(qwen3_dir, "priority", max_num_seqs=1)
    for rid, priority in (("a", 5), ("b", 0), ("c", 0), ("d", -2)):
        engine.add_request(rid, prompt_of(engine, 6), greedy(2), priority=priority)
    timeline: list = []
    drain(engine, timeline)
    assert [rid for kind, rid in timeline if kind == "done"] == ["d", "b", "c", "a"]


def test_fcfs_refuses_a_non_zero_priority(qwen3_dir):
    engine = make_engine(qwen3_dir, "fcfs")
    with pytest.raises(SamplingParamError, match="priority"):
        engine.add_request("x", prompt_of(engine, 6), greedy(2), priority=1)
    assert not engine.requests and not engine.has_unfinished()
    engine.add_request("y", prompt_of(engine, 6), greedy(2), priority=0)
    assert drain(engine, [])["y"]


def _admission_scenario(engine: Engine, low: int = 1) -> tuple[dict[str, list[int]], list]:
    """A long request of priority `low` runs; one of priority 0 arrives that the free pages cannot hold."""
    engine.add_request("low", prompt_of(engine, 20), greedy(16), priority=low)
    timeline: list = []
    tokens = drain(engine, timeline, steps=3)  # its prompt and two decodes: 6 of the 10 pages held
    engine.add_request("high", prompt_of(engine, 20, first=300), greedy(4), priority=0)
    return drain(engine, timeline, tokens), timeline


def test_a_high_priority_request_preempts_a_lower_one_for_pages(qwen3_dir):
    alone = make_engine(qwen3_dir, "priority", pages=10)
    alone.add_request("low", prompt_of(alone, 20), greedy(16))
    expected = drain(alone, [])["low"]

    engine = make_engine(qwen3_dir, "priority", pages=10)
    tokens, timeline = _admission_scenario(engine)
    assert ("preempted", "low") in timeline
    assert timeline.index(("done", "high")) < timeline.index(("done", "low"))
    assert tokens["low"] == expected  # recomputed after the preemption: the same greedy tokens
    assert len(tokens["high"]) == 4
    allocator = engine.caches.allocator
    assert allocator.num_free_pages() == allocator.num_usable_pages()

    fcfs = make_engine(qwen3_dir, "fcfs", pages=10)
    _, fcfs_timeline = _admission_scenario(fcfs, low=0)
    assert not any(kind == "preempted" for kind, _ in fcfs_timeline), "fcfs: the newcomer waits"
    assert fcfs_timeline.index(("done", "low")) < fcfs_timeline.index(("first", "high"))


def test_the_lowest_priority_running_request_is_preempted_for_pages(qwen3_dir):
    """Both fit at admission, not as they grow: the one with the higher value goes, though it arrived
    first (fcfs would preempt the newest)."""
    engine = make_engine(qwen3_dir, "priority", pages=8)
    engine.add_request("early_low", prompt_of(engine, 8), greedy(14), priority=3)
    timeline: list = []
    tokens = drain(engine, timeline, steps=1)  # admitted first: the running list's head
    engine.add_request("late_high", prompt_of(engine, 8, first=300), greedy(14), priority=0)
    drain(engine, timeline, tokens)
    preempted = [rid for kind, rid in timeline if kind == "preempted"]
    assert preempted and set(preempted) == {"early_low"}


def test_llm_generate_takes_a_priority_list(qwen3_dir):
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(qwen3_dir)))
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy="priority",
              kv_cache_memory_bytes=64 * 16 * kv_bytes_per_token(shape, torch.float32))
    prompts = [{"prompt_token_ids": [100 + i, 7, 8]} for i in range(3)]
    outs = llm.generate(prompts, greedy(2), use_tqdm=False, priority=[2, 0, 1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]  # outputs stay in input order
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, greedy(2), use_tqdm=False, priority=[0, 1])
    fcfs = LLM(str(qwen3_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.generate(prompts, greedy(2), use_tqdm=False, priority=[0, 1, 0])
