"""`AsyncEngine`: the engine thread, submission, streaming of deltas, abort, failures, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vlmrun.processors import InputError, ProcessedPrompt
from tests.server_fixtures import served_fixtures, tiny_engine, wait_until_idle
from vlmrun import LLM
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.request_group import EngineDeadError, EngineStepError
from vlmrun.sampling_params import SamplingParams


engine = served_fixtures(max_model_len=256)[0]


def prompt_of(engine: AsyncEngine, text: str) -> ProcessedPrompt:
    return engine.engine.processor.process_prompt(text, [])


async def run_group(engine: AsyncEngine, group_id: str, items) -> dict[int, dict]:
    group = await engine.submit(group_id, items)
    out: dict[int, dict] = {}
    async for batch in group:
        for d in batch:
            o = out.setdefault(d.index, {"text": "", "ids": [], "finish": None})
            o["text"] += d.text
            o["ids"] += d.token_ids
            if d.finished:
                o["finish"], o["n_out"] = d.finish_reason, d.num_output_tokens
    return out


def test_matches_the_offline_api(engine, qwen3_vl_dir):
    params = SamplingParams(temperature=0, max_tokens=10)
    texts = ["Hello there.", "Describe a cat.", "1 2 3"]

    async def main():
        return await asyncio.gather(*(run_group(engine, f"g{i}", [(prompt_of(engine, t), params)])
                                      for i, t in enumerate(texts)))

    results = asyncio.run(main())
    offline = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_model_len=256,
                  kv_cache_memory_bytes=8 << 20).generate(
        [{"prompt": t, "images": []} for t in texts], params, use_tqdm=False)  # templated, as prompt_of
    for res, ref in zip(results, offline):
        assert res[0]["ids"] == ref.token_ids
        assert res[0]["text"] == ref.text
        assert res[0]["finish"] == ref.finish_reason and res[0]["n_out"] == len(ref.token_ids)
    wait_until_idle(engine)


def test_group_of_choices_and_engine_thread_ownership(engine):
    calls: set[str] = set()
    real_step = engine.engine.step

    def spy_step():
        calls.add(threading.current_thread().name)
        return real_step()

    engine.engine.step = spy_step
    try:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6) for s in (1, 2, 3)]
        prompt = prompt_of(engine, "Pick a word.")
        out = asyncio.run(run_group(engine, "choices", [(prompt, p) for p in params]))
    finally:
        del engine.engine.step
    assert sorted(out) == [0, 1, 2]
    assert all(o["finish"] == "length" and len(o["ids"]) == 6 for o in out.values())
    assert calls == {"vlmrun-engine"}


def test_refused_group_is_all_or_nothing(engine):
    good = (prompt_of(engine, "fine"), SamplingParams(max_tokens=4))
    too_long = (prompt_of(engine, "word " * 100), SamplingParams(max_tokens=4))

    async def main():
        with pytest.raises(InputError, match="tokens"):
            await engine.submit("bad-group", [good, too_long])
        with pytest.raises(ValueError):
            await engine.submit("empty", [])

    asyncio.run(main())
    wait_until_idle(engine)  # the good member was taken back out


def test_abort_frees_pages_and_ends_the_stream(engine):
    async def main():
        group = await engine.submit("long", [(prompt_of(engine, "go on"), SamplingParams(max_tokens=200,
                                                                                         ignore_eos=True))])
        first = await group.next_batch()
        assert first and first[0].token_ids
        assert engine.stats.kv_pages_used > 0
        group.abort()
        assert await group.next_batch() == []

    asyncio.run(main())
    wait_until_idle(engine)


def test_cancelled_submit_leaks_nothing(engine):
    async def main():
        task = asyncio.ensure_future(engine.submit("cancelled", [(prompt_of(engine, "x"),
                                                                  SamplingParams(max_tokens=200, ignore_eos=True))]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until_idle(engine)


def test_step_failure_fails_its_requests_and_engine_goes_on(engine):
    real_step = engine.engine.step
    state = {"failed": False}

    def flaky_step():
        # the first step that runs the victim fails (not one that only finishes an earlier test's
        # leftover request on this shared engine, as a cancelled submit can leave one)
        if not state["failed"] and any(rid.startswith("victim-") for rid in engine.engine.requests):
            state["failed"] = True
            raise RuntimeError("boom")
        return real_step()

    engine.engine.step = flaky_step
    try:
        async def main():
            group = await engine.submit("victim", [(prompt_of(engine, "x"), SamplingParams(max_tokens=3))])
            with pytest.raises(EngineStepError, match="boom"):
                async for _ in group:
                    pass
            return await run_group(engine, "survivor", [(prompt_of(engine, "y"), SamplingParams(max_tokens=3))])

        out = asyncio.run(main())
    finally:
        del engine.engine.step
    assert len(out[0]["ids"]) == 3
    wait_until_idle(engine)


def test_shutdown_fails_waiters_and_refuses_new_work(qwen3_vl_dir):
    eng = tiny_engine(qwen3_vl_dir, max_model_len=128)

    async def main():
        group = await eng.submit("running", [(prompt_of(eng, "x"), SamplingParams(max_tokens=120, ignore_eos=True))])
        await group.next_batch()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in group:
                pass
        with pytest.raises(EngineDeadError):
            await eng.submit("late", [(prompt_of(eng, "x"), SamplingParams(max_tokens=2))])

    asyncio.run(main())
    assert not eng.is_running


def test_engine_stats_count_queues_and_pools(qwen3_vl_dir, qwen3_5_dir):
    """`Engine.stats()` (what the async engine publishes): queues, KV pages, request rows and, for a
    hybrid model only, GDN slots (one per running request)."""
    for model_dir, hybrid in ((qwen3_vl_dir, False), (qwen3_5_dir, True)):
        eng = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
                  kv_cache_memory_bytes=8 << 20).engine
        idle = eng.stats()
        assert (idle.num_running, idle.num_waiting, idle.kv_pages_used, idle.req_rows_used) == (0, 0, 0, 0)
        assert idle.kv_pages_total > 0 and idle.req_rows_total == 4
        eng.add_request("a", eng.processor.process_prompt("Hello there.", []),
                        SamplingParams(max_tokens=4, ignore_eos=True))
        assert eng.stats().num_waiting == 1
        eng.step()
        busy = eng.stats()
        assert (busy.num_running, busy.num_waiting, busy.req_rows_used) == (1, 0, 1) and busy.kv_pages_used > 0
        if hybrid:
            assert (busy.gdn_slots_used, busy.gdn_slots_total) == (1, 4) and busy.gdn_usage == 0.25
        else:
            assert busy.gdn_slots_used is None and busy.gdn_slots_total is None and busy.gdn_usage is None
        while eng.has_unfinished():
            eng.step()
        done = eng.stats()
        assert (done.num_running, done.kv_pages_used, done.req_rows_used) == (0, 0, 0)
        assert done.gdn_slots_used == (0 if hybrid else None)
