"""A plain decode step's host work does not grow per request in Python calls (issue 46).

The step's engine side (scheduling the rows, marking them launched and collected, the tokens' text and
updates) makes a fixed number of Python function calls per decoding request: for a streamed request the
row's text (its `tokenizers` stream step through `OutputTextStream.add_plain_token`) and its
`RequestUpdate`; for a request added with `stream=False` (the feed pipeline's: `LLM`, the jobs) none (its
token is appended and its finish rule tested inline; its text is decoded when it finishes). Counted
with a profile hook over one decode step at two batch sizes; the sampling side (its own per-row state,
another piece of work) is left out of the count. And the one-pass paths give what the per-token ones give.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.step_tracing import step_under_hook
from vlmrun.config import EngineConfig
from vlmrun.engine.detokenizer import OutputTextStream
from vlmrun.engine.engine import Engine
from vlmrun.engine.output_processor import OutputProcessor
from vlmrun.engine.request import RequestStatus
from vlmrun.sampling_params import SamplingParams

SAMPLING_FILE_PREFIX = "sampl"  # sampler.py, sampling_batch.py, sampling_params.py and any per-row sampling-state file
MAX_CALLS_PER_REQUEST = {True: 3, False: 0}  # streamed: add_plain_token, IncrementalDetokenizer.append,
# RequestUpdate.__init__; stream=False: none


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def decode_step_calls(model_dir: Path, batch: int, stream: bool) -> Counter:
    """Python calls (file, function) of one plain decode step of `batch` greedy requests."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=16,
                                 max_num_batched_tokens=256, kv_cache_memory_bytes=16 * 1024 * 1024))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13, 17]}), params, stream=stream)
    engine.step()  # the prefills
    engine.step()  # a first decode step (first calls of every path)
    calls: Counter = Counter()

    def count(frame, event, arg):
        if event == "call":
            calls[(Path(frame.f_code.co_filename).name, frame.f_code.co_name)] += 1

    updates = step_under_hook(engine, count, lines=False)
    engine.shutdown()
    assert len(updates) == (batch if stream else 0) and all(len(u.new_token_ids) == 1 for u in updates)
    return Counter({key: n for key, n in calls.items() if not key[0].startswith(SAMPLING_FILE_PREFIX)})


@pytest.mark.parametrize("stream", [True, False])
def test_a_plain_decode_step_makes_a_few_calls_per_request(qwen3_vl_dir, stream: bool) -> None:
    small, large = decode_step_calls(qwen3_vl_dir, 4, stream), decode_step_calls(qwen3_vl_dir, 12, stream)
    growth = {key: (large[key] - small[key]) / 8 for key in large | small if large[key] != small[key]}
    assert sum(growth.values()) <= MAX_CALLS_PER_REQUEST[stream], growth


def random_params(rng: random.Random, eos: int) -> SamplingParams:
    max_tokens, stop = rng.choice([None, 3, 9, 30]), rng.choice([None, None, ["ab"], [" the", "x"]])
    return SamplingParams(max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2, 5]), max_tokens or 5),
                          ignore_eos=rng.random() < 0.3, stop_token_ids=rng.choice([[], [eos - 1], [7, 11]]),
                          stop=stop, skip_special_tokens=rng.random() < 0.7,
                          detokenize=bool(stop) or rng.random() < 0.9)


def test_add_plain_token_gives_what_add_token_gives(tokenizer) -> None:
    rng = random.Random(0)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    special = sorted(tokenizer.all_special_ids)
    ways = Counter()
    for case in range(60):
        params = random_params(rng, eos)
        prompt = [rng.randrange(0, 300) for _ in range(rng.randrange(0, 8))]
        tokens = [rng.choice(special + [7, 11, eos - 1]) if rng.random() < 0.1 else rng.randrange(0, 300)
                  for _ in range(40)]
        plain, full = (OutputTextStream(tokenizer, prompt, params, [eos], max_model_len=40) for _ in range(2))
        for token_id in tokens:
            expected = full.add_token(token_id)
            delta = plain.add_plain_token(token_id)
            got = plain.add_token(token_id) if delta is None else (delta, None, None)
            ways[delta is None] += 1
            assert tuple(got) == tuple(expected), (case, token_id)
            if expected.finish_reason is not None:
                break
        assert plain.text == full.text and plain.finished == full.finished
    assert ways[True] > 50 and ways[False] > 200  # both paths taken


class _Req:
    """The fields of a `Request` the output processor reads and appends to."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams):
        self.request_id, self.prompt_token_ids, self.sampling_params = request_id, prompt, params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict] = []
        self.status = RequestStatus.RUNNING
        self.grammar = None


def test_append_decodes_gives_what_append_one_gives(tokenizer) -> None:
    rng = random.Random(1)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    rows = []
    for i in range(24):
        params = random_params(rng, eos)
        rows.append((f"r{i}", [rng.randrange(0, 300) for _ in range(4)], params))
    by_rows, by_one = OutputProcessor(tokenizer, [eos], 40), OutputProcessor(tokenizer, [eos], 40)
    reqs_rows = [_Req(*row) for row in rows]
    reqs_one = [_Req(*row) for row in rows]
    for req_a, req_b in zip(reqs_rows, reqs_one):
        by_rows.add(req_a)
        by_one.add(req_b)
    num_finishing = 0
    for step in range(12):
        live = [i for i, r in enumerate(reqs_one) if r.status is RequestStatus.RUNNING]
        reqs_rows[live[0]].status = reqs_one[live[0]].status = RequestStatus.FINISHED  # aborted while it ran
        tokens = [rng.choice([eos, 7, rng.randrange(0, 300)]) for _ in live]
        logprobs = [None if i % 3 else {t: -0.5} for i, t in zip(live, tokens)]
        updates, finishing = by_rows.append_decodes([reqs_rows[i] for i in live], tokens, logprobs)
        expected, expected_finishing = [], []
        for i, token_id, lp in zip(live, tokens, logprobs):
            if reqs_one[i].status is RequestStatus.FINISHED:
                continue
            update, reason = by_one.append_one(reqs_one[i], token_id, lp)
            if reason is not None:
                expected_finishing.append((len(expected), rows[i][0], reason))
            expected.append(update)
        assert updates == expected
        assert [(at, req.request_id, reason) for at, req, reason in finishing] == expected_finishing
        num_finishing += len(finishing)
        for at, req, reason in finishing:
            req.status = reqs_one[int(req.request_id[1:])].status = RequestStatus.FINISHED
        if not any(r.status is RequestStatus.RUNNING for r in reqs_one):
            break
    assert num_finishing >= 5
    assert [r.output_token_ids for r in reqs_rows] == [r.output_token_ids for r in reqs_one]
    assert [r.output_logprobs for r in reqs_rows] == [r.output_logprobs for r in reqs_one]
