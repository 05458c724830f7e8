"""Plain decodes run as one `DecodeRows` of columns (executor/step_input.py), not a chunk object per request.

A decode step makes no `ScheduledChunk` / `ChunkInput` per decoding request, and what the rows give is
what the same requests give as chunks: the same tokens and logprobs, seeded or not (the rows keep the
order a step of chunks has, so an unseeded row draws the same noise), with requests that stay chunks
(penalties, a prefill) mixed in, synchronous and under async scheduling.
"""

from __future__ import annotations

import pytest

from vlmrun.config import EngineConfig
from vlmrun.engine import scheduled_chunk, scheduler as scheduler_module
from vlmrun.engine.engine import Engine
from vlmrun.sampling_params import SamplingParams


def make_engine(model_dir, decode_rows: bool, async_scheduling: bool = False) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=8,
                                 max_num_batched_tokens=64, kv_cache_memory_bytes=16 * 1024 * 1024,
                                 async_scheduling=async_scheduling, seed=7))
    engine.scheduler.decode_rows = decode_rows  # before any request is added
    return engine


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": ids}), params)
    results = {}
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                results[update.request_id] = (update.result.token_ids, update.result.logprobs, update.result.text)
    engine.shutdown()
    return results


def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    prompts = [[(7 * i + 3 * j) % 400 + 5 for j in range(6 + 5 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True),  # unseeded: the engine's generator
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3),  # a row too (SamplingState)
        SamplingParams(temperature=0.8, top_k=20, max_tokens=11, ignore_eos=True, seed=5),
        SamplingParams(temperature=1.1, top_p=0.9, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1),  # long prompt: prefill chunks
    ]
    return list(zip(prompts, params))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_give_what_chunks_give(qwen3_vl_dir, async_scheduling: bool) -> None:
    as_rows = run(make_engine(qwen3_vl_dir, True, async_scheduling), mixed_requests())
    as_chunks = run(make_engine(qwen3_vl_dir, False, async_scheduling), mixed_requests())
    assert as_rows == as_chunks
    assert all(len(tokens) > 1 for tokens, _, _ in as_rows.values())


def test_a_decode_step_makes_no_chunk_per_request(qwen3_vl_dir, monkeypatch) -> None:
    engine = make_engine(qwen3_vl_dir, True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for i in range(8):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13, 17]}), params)
    engine.step()  # the prefills: chunks
    made = {"chunks": 0, "inputs": 0}
    chunk_type, to_input = scheduler_module.ScheduledChunk, scheduled_chunk.ScheduledChunk.to_input

    def counting_chunk(*args, **kwargs):
        made["chunks"] += 1
        return chunk_type(*args, **kwargs)

    def counting_input(chunk):
        made["inputs"] += 1
        return to_input(chunk)

    monkeypatch.setattr(scheduler_module, "ScheduledChunk", counting_chunk)
    monkeypatch.setattr(scheduled_chunk.ScheduledChunk, "to_input", counting_input)
    steps = tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(u.new_token_ids) for u in engine.step())
        steps += 1
    engine.shutdown()
    assert steps == 5 and tokens == 8 * 5  # the decode steps ran every request
    assert made == {"chunks": 0, "inputs": 0}


def test_rows_read_each_rows_mrope_delta_as_chunks_do(qwen3_vl_dir) -> None:
    """Image requests (an M-RoPE delta that is not 0) and text requests (delta 0) take turns on the
    page-table rows (max_num_seqs=2 for 6 requests, so rows are reused with another delta): the decode
    rows' positions, read from the runner's per-row deltas, give what chunks give. Every request, image
    or text, must really decode as rows (counted at the runner's launch) in the one run and never in the other."""
    from PIL import Image

    def run_all(decode_rows: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Each request's tokens, and how many decode steps it was given to the runner as a decode row."""
        engine = Engine(EngineConfig(model=str(qwen3_vl_dir), device="cpu", dtype="float32", max_num_seqs=2,
                                     max_num_batched_tokens=256, kv_cache_memory_bytes=16 * 1024 * 1024, seed=7))
        engine.scheduler.decode_rows = decode_rows
        launch, as_rows = engine.executor.launch, {f"r{i}": 0 for i in range(6)}

        def counting(chunks, decodes=None):
            if decodes is None:
                return launch(chunks)
            for r in engine.scheduler.running:
                as_rows[r.request_id] += r.req_pool_idx in decodes.rows
            return launch(chunks, decodes)

        engine.executor.launch = counting
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i in range(6):
            prompt = ({"prompt": "Describe.", "images": [Image.new("RGB", (56 + 28 * i, 56), (40 * i, 90, 200))]}
                      if i % 2 == 0 else {"prompt_token_ids": [5 + i, 9, 13, 17]})
            engine.add_request(f"r{i}", engine.process(prompt), params)
        deltas, tokens = {r.request_id: r.mrope_delta for r in engine.requests.values()}, {}
        try:
            while engine.has_unfinished():
                for update in engine.step():
                    if update.finished:
                        tokens[update.request_id] = update.result.token_ids
        finally:
            engine.shutdown()
        assert deltas["r0"] != 0 and deltas["r1"] == 0
        return tokens, as_rows

    rows_tokens, rows_counts = run_all(True)
    chunks_tokens, chunks_counts = run_all(False)
    assert rows_tokens == chunks_tokens
    # 6 tokens: the prefill samples the first, so 5 decode steps each (as rows: all of them; as chunks: none)
    assert rows_counts == {f"r{i}": 5 for i in range(6)}, rows_counts
    assert set(chunks_counts.values()) == {0}, chunks_counts
