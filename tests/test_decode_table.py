"""The scheduler's per-row decode state (`engine/decode_columns.DecodeTable`, issue 46).

The table mirrors what the requests carry from step to step: it must agree with them after any run of
admissions, page growth, preemptions, aborts and finishes, synchronous and under async scheduling, and the
rows it picks must give what the same requests give as chunks. And a steady decode step's scheduler side
runs a few Python lines per request (a line count, not a clock), where a loop over the requests ran many
(from `FAST_FROM` running requests; below it the rules run one request at a time, as before, cheaper there).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.step_tracing import step_under_hook
from vlmrun.config import EngineConfig
from vlmrun.engine.decode_columns import FAST_FROM, DecodeTable, UnusedDecodeTable
from vlmrun.engine.engine import Engine
from vlmrun.sampling_params import SamplingParams

SCHEDULER_SIDE = {"scheduler.py", "scheduled_chunk.py", "decode_columns.py", "token_map.py", "request.py",
                  "prefix_reuse.py", "queue_policy.py"}
MAX_LINES_PER_REQUEST = 1  # none today (23 before the table); one of slack


def make_engine(model_dir: Path, decode_rows: bool, async_scheduling: bool, fast_from: int = 1, **overrides) -> Engine:
    """A small pool (page_size 4) that preempts; the table read from `fast_from` running requests (1: always)."""
    options = dict(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=24,
                   page_size=4, kv_cache_memory_bytes=64 << 10, async_scheduling=async_scheduling, seed=3)
    engine = Engine(EngineConfig(**{**options, **overrides}))
    engine.scheduler.decode_rows = decode_rows  # before any request is added
    engine.scheduler.decode_table.fast_from = fast_from
    return engine


def assert_table_agrees(engine: Engine) -> tuple[int, int]:
    """Every running request's pages are its row's; a known row's counters are its request's (what
    `DecodeTable` says of them), and a `fast` one has no rule against decoding. -> (known rows, fast rows)"""
    scheduler = engine.scheduler
    table, page_size = scheduler.decode_table, scheduler.page_size
    known = fast = 0
    assert all(req.computed_in is None for req in scheduler.waiting)  # (a preempted one took its count back)
    for req in scheduler.running:  # whoever keeps the count (the table, the request; a stale table too)
        if req.computed_in is not None:
            assert table.known[req.req_pool_idx] and table.holders[req.req_pool_idx] is req, req.request_id
        if req.plain_decode and not req.num_preemptions and req.num_computed_tokens >= req.num_prompt_tokens:
            assert req.num_computed_tokens == req.num_tokens - 1, req.request_id
    if not scheduler.running:
        return 0, 0
    rows = table.rows_of(scheduler.running)
    for req, row, is_fast in zip(scheduler.running, rows.tolist(), table.fast(rows).tolist()):
        assert row == req.req_pool_idx
        assert table.pages[row, :len(req.pages)].tolist() == req.pages
        assert table.room[row] == len(req.pages) * page_size
        assert table.sampling[row] is req.sampling_row and table.lora[row] is req.lora
        if not table.stale:  # a known row's request reads its computed count from the table, no other does
            assert (req.computed_in is table) == bool(table.known[row]), req.request_id
        if table.known[row] and not table.stale:  # (stale: forgotten before the table is read again)
            known += 1
            start = int(table.start[row])
            assert req.num_computed_tokens == start + 1 and req.num_tokens == start + 2, req.request_id
            assert bool(table.in_flight[row]) == bool(req.num_pending_tokens) == bool(req.num_launched_steps)
            if not table.in_flight[row]:
                assert table.last_token[row] == req.output_token_ids[-1], req.request_id
        if is_fast and not table.stale:
            fast += 1
            assert table.known[row] and req.plain_decode
            assert not (req.num_launched_steps and scheduler.must_wait(req)), req.request_id
            assert req.num_computed_tokens < len(req.pages) * page_size
    return known, fast


def random_run(model_dir: Path, decode_rows: bool, async_scheduling: bool, seed: int, check: bool,
               fast_from: int = 1, policy: str = "fcfs") -> tuple[dict[str, list[int]], Counter]:
    """Requests arrive over the steps (greedy, seeded, penalties, min_tokens, a stop token), some are
    aborted; a small KV pool preempts. With priorities a newcomer's prefill may go ahead of decoding
    requests, which then decode as chunks. -> each finished request's tokens, and what the run saw."""
    rng = random.Random(seed)
    engine = make_engine(model_dir, decode_rows, async_scheduling, fast_from=fast_from, scheduling_policy=policy)
    seen: Counter = Counter()
    results: dict[str, list[int]] = {}
    arrivals = sorted(rng.randrange(0, 16) for _ in range(16))
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            i = seen["added"]
            seen["added"] += 1
            kind = rng.choice(["greedy", "greedy", "seeded", "penalty", "min_tokens", "stop"])
            params = SamplingParams(
                temperature=0.0 if kind in ("greedy", "penalty", "stop") else 0.9, seed=7 + i,
                max_tokens=rng.randrange(2, 30), ignore_eos=True, repetition_penalty=1.3 if kind == "penalty" else 1.0,
                min_tokens=2 if kind == "min_tokens" else 0,
                stop_token_ids=[rng.randrange(0, 300)] if kind == "stop" else None)
            ids = [rng.randrange(5, 400) for _ in range(rng.randrange(2, 19))]
            engine.add_request(f"r{i}", engine.process({"prompt_token_ids": ids}), params,
                               priority=rng.randrange(-3, 3) if policy == "priority" else 0)
        if step in (9, 21) and engine.requests:  # an abort, between steps (async: while its step runs)
            engine.abort(sorted(engine.requests)[rng.randrange(len(engine.requests))])
            seen["aborted"] += 1
        for update in engine.step():
            if update.finished:
                results[update.request_id] = update.result.token_ids
        if check:
            known, fast = assert_table_agrees(engine)
            seen["known"] += known
            seen["fast"] += fast
        step += 1
    seen["preemptions"] = engine.stats().num_preemptions
    assert engine.stats().kv_pages_used == 0
    engine.shutdown()
    return results, seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_table_agrees_with_the_requests_and_rows_give_what_chunks_give(qwen3_vl_dir, async_scheduling):
    # (fast_from 3: the running set crosses it, rules and table take turns)
    for seed, fast_from, policy in ((0, 1, "fcfs"), (1, 1, "priority"), (2, 3, "fcfs"), (3, 1, "priority")):
        as_rows, seen = random_run(qwen3_vl_dir, True, async_scheduling, seed, True, fast_from, policy)
        as_chunks, _ = random_run(qwen3_vl_dir, False, async_scheduling, seed, False, fast_from, policy)
        assert as_rows == as_chunks, seed
        assert seen["preemptions"] > 0 and seen["aborted"] and seen["fast"] > 40, (seed, seen)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_leaving_the_table_takes_its_computed_count_back(qwen3_vl_dir, async_scheduling):
    """While its row is known the table keeps a request's computed count (`Request.computed_in`); a request
    that finishes, is aborted or is preempted holds its own again, as the table last had it."""
    engine = make_engine(qwen3_vl_dir, True, async_scheduling, kv_cache_memory_bytes=8 << 20)
    for i, max_tokens in enumerate((6, 9, 12)):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13]}),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    requests = dict(engine.requests)
    for _ in range(4):  # the prefills, a first decode by the rules, then through the table
        engine.step()
    assert all(r.computed_in is engine.scheduler.decode_table for r in requests.values())
    aborted = requests["r2"]
    engine.abort("r2")
    assert aborted.computed_in is None and aborted.num_computed_tokens == aborted.num_tokens - 1
    while engine.has_unfinished():
        engine.step()
    for req in (requests["r0"], requests["r1"]):
        assert req.computed_in is None and req.num_computed_tokens == req.num_tokens - 1, req.request_id
    preempted = make_engine(qwen3_vl_dir, True, async_scheduling)  # (the small pool: someone is preempted)
    for i in range(6):
        preempted.add_request(f"p{i}", preempted.process({"prompt_token_ids": [5 + i, 9, 13, 17, 21]}),
                              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while not preempted.stats().num_preemptions:
        preempted.step()
    assert all(r.computed_in is None and r.num_computed_tokens == 0 for r in preempted.scheduler.waiting)


def test_steady_steps_hand_the_runner_the_same_sampling_rows_list(qwen3_vl_dir):
    """While no row changes hands a decode step's sampling rows are the list the step before had (the runner's
    sampling state then checks no row again); a finished request's row makes a new one."""
    engine = make_engine(qwen3_vl_dir, True, False, kv_cache_memory_bytes=8 << 20)
    for i, max_tokens in enumerate((5, 12, 12)):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13]}),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    lists = []
    original = engine.executor.launch

    def launch(chunks, decodes=None):
        if decodes is not None and not chunks:
            lists.append((decodes.sampling, len(engine.scheduler.running)))
        return original(chunks, decodes) if decodes is not None else original(chunks)

    engine.executor.launch = launch  # (an observer: it calls through)
    while engine.has_unfinished():
        engine.step()
    same = [a is b for (a, _), (b, _) in zip(lists, lists[1:])]
    changed = [n != m for (_, n), (_, m) in zip(lists, lists[1:])]
    assert sum(same) >= len(lists) - 4 and not any(s and c for s, c in zip(same, changed)), (same, changed)
    assert [r.params.max_tokens for r in lists[-1][0]] == [12, 12]


def test_a_row_changing_hands_gives_new_columns_for_the_same_rows():
    """Rows handed to another request between two steps of equal rows: new lists, with the new holder's row."""
    table = DecodeTable(num_rows=3, max_pages=4, page_size=4)
    a, b, c = (SimpleNamespace(pages=[1], plain_decode=True, decode_wait_tokens=99, sampling_row=(name,), lora=None,
                               computed_in=None) for name in "abc")
    table.admit(a, 0)
    table.admit(b, 1)
    first = table.columns_of([0, 1])
    assert table.columns_of([0, 1]) is first  # steady: the same lists
    table.release(1)
    table.admit(c, 1)
    again = table.columns_of([0, 1])  # equal rows, row 1 now c's
    assert again is not first and again[0] == [("a",), ("c",)]


def test_page_opening_rows_take_their_pages_in_one_go(qwen3_vl_dir):
    """Rows whose next token opens a page at the same step take free pages in one allocation, in running
    order (the pages one at a time would give them), and the step keeps them as one run of rows."""
    engine = make_engine(qwen3_vl_dir, True, False, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13]}), params)
    engine.step()  # prefill: 3 tokens, one page each
    engine.step()  # first decode, position 3 (one at a time: no row is known yet)
    scheduler, allocator = engine.scheduler, engine.scheduler.allocator
    assert all(len(r.pages) == 1 and r.num_computed_tokens == 4 for r in scheduler.running)
    expected = allocator.free_pages[::-1][:5]  # the pages alloc(1) five times would pop, in order
    calls = []
    alloc = allocator.alloc
    allocator.alloc = lambda n: calls.append(n) or alloc(n)
    _, decodes, _ = scheduler.schedule()  # position 4 opens every request's second page
    assert calls == [5] and [r.pages[1] for r in scheduler.running] == expected
    assert decodes.starts == [4] * 5 and decodes.all_known
    assert decodes.slots == [page * 4 for page in expected]
    engine.shutdown()


def scheduler_side_lines(model_dir: Path, batch: int) -> int:
    """Python lines run in the scheduler side's files during one steady plain decode step of `batch` requests."""
    engine = make_engine(model_dir, True, False, fast_from=FAST_FROM, max_num_seqs=80, max_num_batched_tokens=512,
                         page_size=16, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13, 17]}), params)
    engine.step()  # the prefills
    engine.step()  # a first decode
    lines: Counter = Counter()

    def trace(frame, event, arg):
        if Path(frame.f_code.co_filename).name not in SCHEDULER_SIDE:
            return None
        if event == "line":
            lines[frame.f_code.co_name] += 1
        return trace

    updates = step_under_hook(engine, trace, lines=True)
    engine.shutdown()
    assert len(updates) == batch
    return sum(lines.values())


def test_a_steady_decode_step_runs_few_scheduler_lines_per_request(qwen3_vl_dir):
    small, large = scheduler_side_lines(qwen3_vl_dir, FAST_FROM), scheduler_side_lines(qwen3_vl_dir, FAST_FROM + 16)
    assert (large - small) / 16 <= MAX_LINES_PER_REQUEST, (small, large)


def test_slots_are_the_pages_positions():
    table = DecodeTable(num_rows=3, max_pages=4, page_size=4)
    table.grow(0, 0, [7, 2])
    table.grow(2, 0, [5])
    table.grow(2, 1, [1, 9])
    rows, positions = np.array([0, 0, 2, 2, 2]), np.array([3, 4, 0, 7, 11])
    assert table.slots(rows, positions).tolist() == [31, 8, 20, 7, 39]
    assert table.room.tolist() == [8, 0, 12]


def test_penalty_rows_take_the_fast_path_when_steps_do_not_overlap(qwen3_vl_dir):
    """A request that reads its output ids (a penalty) must wait for its launched step under async scheduling;
    a synchronous engine never has one when it schedules, so after its first decode such a request is a fast
    row like any other (not picked one at a time by the rules every step)."""
    engine = make_engine(qwen3_vl_dir, True, False, max_num_seqs=4, max_num_batched_tokens=64,
                         kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.1)
    for i in range(3):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13]}), params)
    engine.step()  # prefill
    engine.step()  # first decode: by the rules (no row known yet)
    scheduler, picked_by_rules = engine.scheduler, []
    by_rules = scheduler._pick_by_rules
    scheduler._pick_by_rules = lambda decodes, budget, i, stop: picked_by_rules.append(stop - i) or by_rules(
        decodes, budget, i, stop)
    while engine.has_unfinished():
        engine.step()
    engine.shutdown()
    # (a page opening needs no rule either while free pages cover it)
    assert sum(picked_by_rules) == 0, picked_by_rules


def test_a_speculating_engine_keeps_no_decode_table(qwen3_vl_dir):
    """With speculative decoding every request is verified as a chunk (no decode rows): the scheduler keeps no
    per-row decode table (its writes go to an `UnusedDecodeTable`), and the tokens are those of the plain engine."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for speculative_config in (spec, None):
        engine = Engine(EngineConfig(model=str(qwen3_vl_dir), device="cpu", dtype="float32", max_num_seqs=4,
                                     page_size=4, kv_cache_memory_bytes=256 << 10, speculative_config=speculative_config))
        for i in range(3):
            engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 5 + i, 9]}), params)
        engine.step()
        table = engine.scheduler.decode_table
        assert engine.scheduler.decode_rows == (speculative_config is None)  # (the CPU runner takes decode rows)
        assert isinstance(table, UnusedDecodeTable) == (speculative_config is not None)
        assert speculative_config is not None or table.pages.any()  # the plain engine's mirrors its pages
        results = {}
        while engine.has_unfinished():
            results.update((u.request_id, u.result.token_ids) for u in engine.step() if u.result is not None)
        tokens.append(results)
        engine.shutdown()
    assert tokens[0] == tokens[1]
