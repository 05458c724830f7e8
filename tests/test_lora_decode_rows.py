"""A LoRA engine's plain decodes run as `DecodeRows` columns (each row with its adapter), not a chunk per request.

The rows of base-model and adapted requests decode together, each through its own adapter (the step's
`LoRAAdapters`, executor/step_features.py, binds the decode rows first, then the chunks' rows), and give
what the same requests give as per-request chunks (the path tests/test_lora.py checks against HF + PEFT):
the same tokens and logprobs, greedy, seeded and unseeded, eager and padded to buckets, synchronous and
under async scheduling.
"""

from __future__ import annotations

import pytest

from testing.lora_adapters import TEXT_LINEARS, build_peft_adapter
from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> list[LoRARequest]:
    folder = tmp_path_factory.mktemp("lora_rows")
    return [LoRARequest(f"a{i}", i, str(build_peft_adapter(qwen3_dir, folder / f"a{i}", target_modules=TEXT_LINEARS,
                                                           r=4, lora_alpha=8, seed=i)))
            for i in (1, 2)]


def make_engine(model_dir, decode_rows: bool, async_scheduling: bool, eager: bool) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=8,
                                 max_num_batched_tokens=64, kv_cache_memory_bytes=16 * 1024 * 1024,
                                 async_scheduling=async_scheduling, seed=7, enable_lora=True, max_loras=2,
                                 max_lora_rank=8, enforce_eager=eager))
    if not decode_rows:
        engine.scheduler.decode_rows = False  # before any request is added: every decode a chunk
    return engine


def run(engine: Engine, adapters: list[LoRARequest]) -> tuple[dict[str, tuple], int]:
    """Six requests (base, adapter 1, adapter 2, twice over, greedy / seeded / unseeded): their results, and
    how many decode rows the runner was given."""
    launch, rows = engine.executor.launch, [0]

    def counting(chunks, decodes=None):
        rows[0] += 0 if decodes is None else len(decodes)
        return launch(chunks, decodes) if decodes is not None else launch(chunks)

    engine.executor.launch = counting
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=7, ignore_eos=True, seed=5),
              SamplingParams(temperature=1.1, max_tokens=6, ignore_eos=True)]  # unseeded: the engine's generator
    loras = [None, *adapters]
    for i in range(6):
        prompt = [(7 * i + 3 * j) % 400 + 5 for j in range(5 + 2 * i)]
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": prompt}), params[i // 2],
                           lora_request=loras[i % 3])
    results = {}
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                results[update.request_id] = (update.result.token_ids, update.result.logprobs)
    engine.shutdown()
    return results, rows[0]


@pytest.mark.parametrize("async_scheduling,eager", [(False, True), (True, False)])
def test_lora_decodes_run_as_rows_and_give_what_chunks_give(qwen3_dir, adapters, async_scheduling, eager):
    as_rows, rows = run(make_engine(qwen3_dir, True, async_scheduling, eager), adapters)
    as_chunks, chunk_rows = run(make_engine(qwen3_dir, False, async_scheduling, eager), adapters)
    assert chunk_rows == 0
    assert rows >= 6 * 4, rows  # (most of) every request's decodes went as rows
    assert as_rows == as_chunks



@pytest.mark.parametrize("eager", [True, False])
def test_a_dropped_lora_engine_is_freed_by_reference_counts(qwen3_dir, adapters, eager):
    """The LoRA binding holds no bound method of the runner (a cycle): a dropped LoRA engine frees its runner
    and caches at once, even with the startup heap frozen (gc.freeze: cycles among frozen objects are
    never collected while the process runs)."""
    import gc
    import weakref

    engine = make_engine(qwen3_dir, True, False, eager)
    for i, lora in enumerate([None, *adapters]):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5, 6, 7 + i]}),
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), lora_request=lora)
    while engine.has_unfinished():
        engine.step()
    runner = weakref.ref(engine.executor)
    gc.disable()  # freed by reference counts alone, or not at all
    try:
        del engine
        assert runner() is None, "the runner outlived its engine: a reference cycle holds it"
    finally:
        gc.enable()
