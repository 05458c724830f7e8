"""The engine's one output shape: `Engine.step()` updates, and the result a finished one carries.

Whatever consumes the engine (`LLM`, the async engine, the caption pipeline) reads only these: the
streamed pieces of a request add up to its result, and the engine forgets a request in the step
that finishes it, so nothing is left to release.
"""

from __future__ import annotations

from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.sampling_params import SamplingParams


def test_streamed_pieces_add_up_to_the_result_and_the_engine_forgets_the_request(qwen3_dir) -> None:
    engine = Engine(EngineConfig(model=str(qwen3_dir), dtype="float32", device="cpu", max_model_len=256,
                                 kv_cache_memory_bytes=8 << 20))
    asks = {"plain": SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            "logprobs": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
            "seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True)}
    for rid, params in asks.items():
        engine.add_request(rid, engine.process(f"Tell me about {rid}."), params)
    streamed = {rid: ([], [], "") for rid in asks}
    results = {}
    while engine.has_unfinished():
        for update in engine.step():
            ids, lps, text = streamed[update.request_id]
            streamed[update.request_id] = (ids + update.new_token_ids, lps + update.new_logprobs,
                                           text + update.text_delta)
            if update.finished:
                assert update.request_id not in results
                results[update.request_id] = update.result
                assert update.request_id not in engine.requests  # forgotten in the step that finished it
    assert set(results) == set(asks) and not engine.requests
    for rid, result in results.items():
        ids, lps, text = streamed[rid]
        assert result.token_ids == ids and result.num_output_tokens == asks[rid].max_tokens
        assert result.text == text and result.finish_reason == "length"
        assert result.logprobs == (lps if asks[rid].logprobs is not None else None)
        assert result.num_prompt_tokens > 0 and result.arrival_time <= result.first_token_time
        assert not result.grammar_ended
    assert all(len(lp) == 2 for lp in results["logprobs"].logprobs)  # greedy: the sampled token is the top one
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.req_rows_used == 0
