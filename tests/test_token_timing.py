"""`TokenTiming` (`engine/token_timing.py`): the per-step token metrics the engine keeps for the server.

On a batch of requests streamed and not (`stream=False`), some ending early on a stop token while a decode
step of theirs was already launched (async scheduling), some on their length: the tokens counted are the
outputs' tokens (a released row's token in a step still running is not one), one inter-token latency per
output token after a request's first, and the tokens-per-step histogram sums prompt + output tokens. The
numpy histogram puts values in the buckets `bisect` does (Prometheus' `le`).
"""

from __future__ import annotations

import numpy as np
import pytest

from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.engine.step_tokens import BucketHistogram
from vlmrun.engine.token_timing import ITL_BUCKETS, TokenTiming
from vlmrun.sampling_params import SamplingParams


def test_bucket_histogram_array_equals_one_at_a_time():
    values = np.array([0.0, 0.01, 0.0100001, 0.3, 0.31, 80.0, 81.0, 5.0, 0.075])
    one, many = BucketHistogram(ITL_BUCKETS), BucketHistogram(ITL_BUCKETS)
    for v in values.tolist():
        one.observe(v)
    many.observe_array(values)
    many.observe_array(values[:0])
    assert many.counts == one.counts and many.count == one.count == len(values)
    assert many.sum == pytest.approx(one.sum)
    assert many.cumulative()[-1] == ("+Inf", len(values)) and many.cumulative()[0] == ("0.01", 2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_token_counts_equal_the_outputs(qwen3_dir, async_scheduling):
    engine = Engine(EngineConfig(model=str(qwen3_dir), dtype="float32", device="cpu", max_model_len=256,
                                 max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20,
                                 async_scheduling=async_scheduling))
    timing = engine.token_timing = TokenTiming(engine.caches.req_to_token.max_reqs)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("ref", engine.process({"prompt_token_ids": [5, 9, 13]}), greedy)
    reference = run(engine, timing)["ref"].token_ids
    timing.__init__(engine.caches.req_to_token.max_reqs)  # counts from here
    asks = {f"len{i}": SamplingParams(temperature=0, max_tokens=1 + 2 * i, ignore_eos=True) for i in range(4)}
    asks |= {f"stop{i}": SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[reference[i + 1]])
             for i in range(3)}  # ends on its (i + 2)-th token, its next decode step already launched (async)
    for i, (rid, params) in enumerate(asks.items()):
        engine.add_request(rid, engine.process({"prompt_token_ids": [5, 9, 13] if rid.startswith("stop") else
                                                [5 + i, 9, 13, 17]}), params, stream=i % 2 == 0)
    results = run(engine, timing)
    outputs = [r.num_output_tokens for r in results.values()]
    assert [results[f"stop{i}"].num_output_tokens for i in range(3)] == [2, 3, 4]  # (the early finishes happen)
    assert timing.generated == sum(outputs)
    assert timing.gaps.count == sum(k - 1 for k in outputs) and timing.gaps.sum >= 0
    assert timing.step_tokens.sum == sum(r.num_prompt_tokens + r.num_output_tokens for r in results.values())
    assert timing.step_tokens.count >= max(outputs)
    assert np.isnan(timing.last).all()  # every row released


def run(engine: Engine, timing: TokenTiming) -> dict:
    results = {}
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                results[update.request_id] = update.result
        timing.end_step()
    return results
