"""A request whose consumer reads only its result (`Engine.add_request(..., stream=False)`) gets the same
result as a streamed one, without per-step output work.

- `IncrementalDetokenizer.extend` and `extend_and_flush` (the final text in one go) give what `append` per
  token gives, then `flush`, on random ids over the tiny and the bundled tokenizer and on text (multi-byte characters split
  across tokens, special tokens skipped or kept, `spaces_between_special_tokens`).
- The output processor's final-only rows give the streamed rows' result, field by field, for every finish
  rule (stop ids, include_stop_str_in_output, min_tokens, length, EOS, ignore_eos, stop strings,
  detokenize=False), through `append_decodes` and `append` (several tokens a step).
- The engine: a batch of such requests (sync and async scheduling) finishes with the streamed batch's
  results; between its first token and its last a request gets no update and no detokenizer call;
  `LLM.generate` (the feed pipeline, which adds its requests so) gives the streamed engine's outputs.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.step_tracing import step_under_hook
from vlmrun import LLM
from vlmrun.config import EngineConfig
from vlmrun.engine.detokenizer import IncrementalDetokenizer
from vlmrun.engine.engine import Engine
from vlmrun.engine.final_output import FinalOutput
from vlmrun.engine.output_processor import OutputProcessor
from vlmrun.engine.request import RequestStatus
from vlmrun.sampling_params import SamplingParams

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "model" / "vlmrun-shapes-qwen3_5"
TEXTS = ["The image shows a red cat that is sitting on the left.", "Emoji: 😀 🐱 🚗 ❤️ 👍 and 🦀🦀!",
         "東京の夜景はとても綺麗です。", "Ünïcödé: Straße, façade, crème brûlée — “quotes” … ok"]
TIMES = ("arrival_time", "first_token_time", "finished_time", "scheduled_time")


@pytest.fixture(scope="module", params=["tiny", "bundled"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    path = request.getfixturevalue("tiny_tokenizer_dir") if request.param == "tiny" else BUNDLED
    return AutoTokenizer.from_pretrained(str(path))


def token_source(tokenizer: Any, rng: random.Random, kind: int):
    """Ids of one kind: 0 random over the vocabulary, 1 tokens of text (and specials), 2 whole texts (and
    specials): at least n ids."""
    special = sorted(tokenizer.all_special_ids)
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    pool = [i for ids in texts for i in ids]

    def draw(n: int) -> list[int]:
        if kind == 0:
            return [rng.randrange(len(tokenizer)) for _ in range(n)]
        if kind == 1:
            return [rng.choice(special) if rng.random() < 0.1 else rng.choice(pool) for _ in range(n)]
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(texts) + [rng.choice(special)]
        return out
    return draw


def test_extend_gives_the_text_of_append_per_token(tokenizer) -> None:
    rng = random.Random(0)
    at_once = Counter()
    for case in range(600):
        draw = token_source(tokenizer, rng, case % 3)
        context = draw(rng.randrange(0, 7)) if case % 3 < 2 else tokenizer.encode(TEXTS[0])[-rng.randrange(1, 6):]
        ids = draw(rng.randrange(0, 50))
        options = (rng.random() < 0.5, rng.random() < 0.8)  # skip_special_tokens, spaces_between_special_tokens
        per_token = IncrementalDetokenizer(tokenizer, context, *options)
        for token_id in ids:
            per_token.append(token_id)
        probe, together = (IncrementalDetokenizer(tokenizer, context, *options) for _ in range(2))
        at_once[case % 3, probe._extend_at_once(ids)] += 1  # which way extend goes here
        together.extend(ids)
        assert together.text == per_token.text, (context, ids, options)
        together.flush()
        per_token.flush()
        assert together.text == per_token.text, (context, ids, options)
    assert at_once[2, True] > 120 and at_once[0, False] > 120  # both ways taken


def test_extend_and_flush_gives_the_text_of_append_per_token_then_flush(tokenizer) -> None:
    """A finished request's text in one decode: what `append` per token and `flush` give, U+FFFD in the
    text or not (random ids split characters everywhere), and the detokenizer carries on as after them."""
    rng = random.Random(1)
    at_once = Counter()
    for case in range(900):
        draw = token_source(tokenizer, rng, case % 3)
        context = draw(rng.randrange(0, 7))
        ids, more = draw(rng.randrange(0, 50)), draw(rng.randrange(0, 6))
        options = (rng.random() < 0.5, rng.random() < 0.8)  # skip_special_tokens, spaces_between_special_tokens
        per_token, together, probe = (IncrementalDetokenizer(tokenizer, context, *options) for _ in range(3))
        for token_id in ids:
            per_token.append(token_id)
        per_token.flush()
        taken = probe._at_once(list(ids), lambda added: True)  # (what extend_and_flush tries first)
        at_once[case % 3, taken, "\ufffd" in probe.text, probe._stream is not None] += 1
        together.extend_and_flush(ids)
        assert together.text == per_token.text, (context, ids, options)
        assert together.output_token_ids == per_token.output_token_ids and not together.num_pending_tokens
        for token_id in more:  # appended after (a request does not, but the object stays whole)
            per_token.append(token_id)
            together.append(token_id)
        together.flush()
        per_token.flush()
        assert together.text == per_token.text, (context, ids, more, options)
    assert at_once[0, True, True, True] > 60  # the one decode with U+FFFD in the text
    assert at_once[2, True, False, True] > 150  # and whole texts
    assert at_once[0, False, False, False] > 20  # no stream (spaces_between_special_tokens=False): token by token


def lone_byte_token(tokenizer) -> int:
    """An id whose text alone is U+FFFD (one byte of a multi-byte character)."""
    return next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")


def test_a_prompt_ending_inside_a_character_adds_none_of_its_text(tokenizer) -> None:
    """A prompt whose last token is a lone byte of a character: the output's text is the output ids decoded
    alone (HF's text), streamed or final-only. A stream primed with such a context gave the prompt's own
    text with its first piece ('h\ufffd world' for ' world')."""
    context = tokenizer.encode("The word is h", add_special_tokens=False) + [lone_byte_token(tokenizer)]
    outputs = tokenizer.encode(" world, and more", add_special_tokens=False)
    expected = tokenizer.decode(outputs, skip_special_tokens=True)
    streamed = IncrementalDetokenizer(tokenizer, context)
    for token_id in outputs:
        streamed.append(token_id)
    streamed.flush()
    final = FinalOutput(tokenizer, [1, 2] + context, SamplingParams(max_tokens=len(outputs)), [0], None)
    final.finish_reason(outputs)
    assert streamed.text == expected and final.final_text(outputs)[0] == expected


class RaisingStream:
    """A `DecodeStream` whose per-token step raises from its `after`-th call on (as one whose decoder's window
    text does not extend its prefix would)."""

    def __init__(self, stream: Any, after: int):
        self.stream, self.calls, self.after = stream, 0, after

    def step(self, backend: Any, token_id: int) -> Any:
        self.calls += 1
        if self.calls >= self.after:
            raise ValueError("the window's text does not extend its prefix")
        return self.stream.step(backend, token_id)


def test_extend_falls_back_where_the_stream_raises(tokenizer) -> None:
    """Token by token (random ids: the one-call way refuses them), the stream raising at some token: extend
    drops it there, as append does, and the window decode gives the rest: the same text either way."""
    taken = Counter()
    rng = random.Random(2)
    for case in range(40):
        context, ids = ([rng.randrange(len(tokenizer)) for _ in range(n)] for n in (4, 30))
        after = rng.randrange(1, 45)
        per_token, together = (IncrementalDetokenizer(tokenizer, context, True) for _ in range(2))
        per_token._stream = RaisingStream(per_token._stream, after)
        together._stream = RaisingStream(together._stream, after)
        for token_id in ids:
            per_token.append(token_id)
        together.extend(ids)
        taken[together._stream is None] += 1
        assert (together._stream is None) == (per_token._stream is None) == (after <= len(ids))
        assert together.text == per_token.text and together.num_pending_tokens == per_token.num_pending_tokens
        together.flush()
        per_token.flush()
        assert together.text == per_token.text, (context, ids, after)
    assert taken[True] > 10 and taken[False] > 3


def random_params(rng: random.Random, eos: int, text: str) -> SamplingParams:
    """`text`: a piece of the row's output text, a stop string that may well end it."""
    max_tokens = rng.choice([None, 1, 3, 9, 30])
    stop = rng.choice([None, None, None, [text[:2] or "e"], [" the", "x", text[1:3] or "a"]])
    return SamplingParams(max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2, 5]), max_tokens or 5),
                          ignore_eos=rng.random() < 0.3, stop_token_ids=rng.choice([[], [eos - 1], [7, 11], [13]]),
                          stop=stop, skip_special_tokens=rng.random() < 0.7,
                          spaces_between_special_tokens=rng.random() < 0.8,
                          include_stop_str_in_output=rng.random() < 0.3, logprobs=rng.choice([None, 1]),
                          detokenize=bool(stop) or rng.random() < 0.9)


def fake_request(request_id: str, prompt: list[int], params: SamplingParams) -> SimpleNamespace:
    """The fields of a `Request` the output processor reads and appends to."""
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                           output_token_ids=[], output_logprobs=[], status=RequestStatus.RUNNING, grammar=None,
                           num_prompt_tokens=len(prompt), arrival_time=0.0, first_token_time=0.0,
                           prompt=SimpleNamespace(text=""), prompt_logprobs=None, spec_decode=None,
                           scheduled_time=0.0, prefix_hit_tokens=0)


def fields(result) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k not in TIMES}


def test_final_only_rows_give_the_streamed_result(tokenizer) -> None:
    rng = random.Random(1)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    reasons = Counter()
    for batch in range(12):
        streamed, final = OutputProcessor(tokenizer, [eos], 40), OutputProcessor(tokenizer, [eos], 40)
        rows = {}
        for i in range(16):
            prompt = token_source(tokenizer, rng, i % 3)(rng.randrange(1, 6))
            draw = token_source(tokenizer, rng, i % 3)
            # tokens mostly of the row's kind, with the finish rules' ids sprinkled in
            tokens = [rng.choice([eos, 7, 13, eos - 1]) if rng.random() < 0.08 else t for t in draw(45)]
            params = random_params(rng, eos, tokenizer.decode(tokens[rng.randrange(2, 20):][:3]))
            pair = fake_request(f"r{i}", prompt, params), fake_request(f"r{i}", prompt, params)
            streamed.add(pair[0])
            final.add(pair[1], stream=False)
            rows[f"r{i}"] = (pair, tokens)
        results: dict[str, list] = {rid: [None, None] for rid in rows}
        updates_seen = Counter()
        for step in range(45):
            live = [rid for rid in rows if results[rid][0] is None]
            if not live:
                break
            several = step % 4 == 3  # `append` with several tokens a step (accepted drafts) on these steps
            for side, processor in enumerate((streamed, final)):
                reqs = [rows[rid][0][side] for rid in live]
                if several:
                    for req in reqs:
                        tokens = rows[req.request_id][1]
                        n = len(req.output_token_ids)
                        sampled = [SimpleNamespace(token_id=t, logprobs={t: -1.0} if req.sampling_params.logprobs
                                                   else None) for t in tokens[n:n + 3]]
                        update, reason = processor.append(req, sampled)
                        updates_seen[side, req.request_id] += update is not None
                        if reason is not None:
                            req.status = RequestStatus.FINISHED
                            results[req.request_id][side] = processor.result(req, reason)
                    continue
                ids = [rows[req.request_id][1][len(req.output_token_ids)] for req in reqs]
                logprobs = [{t: -0.5} if req.sampling_params.logprobs else None for req, t in zip(reqs, ids)]
                updates, finishing = processor.append_decodes(reqs, ids, logprobs)
                for update in updates:
                    updates_seen[side, update.request_id] += 1
                    if side == 1:
                        assert not update.new_token_ids and not update.text_delta  # final-only: empty
                for _, req, reason in finishing:
                    req.status = RequestStatus.FINISHED
                    results[req.request_id][side] = processor.result(req, reason)
        for rid, (want, got) in results.items():
            assert want is not None and got is not None, rid
            assert fields(got) == fields(want), (rid, rows[rid][0][0].sampling_params)
            assert updates_seen[1, rid] <= 2  # its first token and its last, nothing between
            params = rows[rid][0][0].sampling_params
            reasons[want.finish_reason, type(want.stop_reason).__name__, params.detokenize] += 1
    for case in [("stop", "int", True), ("stop", "str", True), ("stop", "NoneType", True), ("length", "NoneType", True),
                 ("length", "NoneType", False)]:  # stop id, stop string, EOS, length; detokenize=False
        assert reasons[case] >= 3, (case, reasons)


def make_engine(model_dir: Path, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_model_len=256,
                               max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20,
                               **overrides))


def engine_batch(engine: Engine, reference: list[int]) -> dict[str, SamplingParams]:
    """Requests that end by each rule, given the tokens a plain greedy run of the first prompt gives."""
    text = engine.tokenizer.decode(reference[2:5])
    return {"plain": SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            "logprobs": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
            "seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True),
            "stop_id": SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[reference[3]]),
            "stop_id_kept": SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[reference[3]],
                                           include_stop_str_in_output=True),
            "min_tokens": SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[reference[1]], min_tokens=4),
            "stop_string": SamplingParams(temperature=0, max_tokens=12, stop=[text[1:3] or "e"]),
            "no_text": SamplingParams(temperature=0, max_tokens=5, detokenize=False),
            "specials": SamplingParams(temperature=0, max_tokens=8, skip_special_tokens=False)}


def run(engine: Engine, asks: dict[str, SamplingParams], stream: bool) -> tuple[dict, Counter]:
    for rid, params in asks.items():
        engine.add_request(rid, engine.process({"prompt_token_ids": [5, 9, 13, 17, 21]}), params, stream=stream)
    results, updates = {}, Counter()
    while engine.has_unfinished():
        for update in engine.step():
            updates[update.request_id] += 1
            if update.finished:
                results[update.request_id] = update.result
    return results, updates


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_final_only_results_equal_streamed_results(qwen3_dir, async_scheduling) -> None:
    engine = make_engine(qwen3_dir, async_scheduling=async_scheduling)
    reference, _ = run(engine, {"ref": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)}, stream=True)
    asks = engine_batch(engine, reference["ref"].token_ids)
    streamed, _ = run(engine, asks, stream=True)
    final, updates = run(engine, asks, stream=False)
    assert set(final) == set(streamed) == set(asks)
    for rid in asks:
        assert fields(final[rid]) == fields(streamed[rid]), rid
        assert updates[rid] == (1 if final[rid].num_output_tokens == 1 else 2), rid  # first token, last
    assert streamed["stop_id"].stop_reason == reference["ref"].token_ids[3]
    assert streamed["stop_string"].stop_reason is not None and streamed["plain"].text
    assert not engine.requests and engine.stats().kv_pages_used == 0


def test_a_final_only_request_costs_no_per_step_output_work(qwen3_dir) -> None:
    """Between its first token and its last, a request added with stream=False gets no update and no call
    into the detokenizer (a streamed one gets both every step: the count is not vacuous)."""
    engine = make_engine(qwen3_dir)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, stream in enumerate([False] * 3 + [True]):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13]}), params, stream=stream)
    engine.step()  # the prefills: every request's first token (and its one update)
    calls: Counter = Counter()
    detokenizer_files = {"detokenizer.py", "incremental_detokenizer.py", "final_output.py", "stop_strings.py"}

    def count(frame, event, arg):
        if event == "call" and Path(frame.f_code.co_filename).name in detokenizer_files:
            calls[frame.f_code.co_name] += 1
        elif event == "c_call" and getattr(arg, "__qualname__", "") == "DecodeStream.step":
            calls["DecodeStream.step"] += 1

    middle: list = []
    for _ in range(4):  # outputs 2..5 of 6: neither the first nor the last
        middle += step_under_hook(engine, count, lines=False)
    assert [u.request_id for u in middle] == ["r3"] * 4  # only the streamed request
    assert calls == Counter({"add_plain_token": 4, "append": 4, "DecodeStream.step": 4}), calls  # r3's alone
    last = engine.step()
    assert sorted(u.request_id for u in last) == ["r0", "r1", "r2", "r3"] and all(u.finished for u in last)
    assert all(u.result.num_output_tokens == 6 for u in last)


def test_llm_generate_gives_the_streamed_engine_outputs(qwen3_dir) -> None:
    """The feed pipeline adds its requests with stream=False: its outputs are the streamed engine's."""
    options = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=8 << 20)
    llm = LLM(str(qwen3_dir), **options)
    reference, _ = run(llm.engine, {"ref": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)}, stream=True)
    asks = engine_batch(llm.engine, reference["ref"].token_ids)
    streamed, _ = run(llm.engine, asks, stream=True)
    outs = llm.generate([{"prompt_token_ids": [5, 9, 13, 17, 21]}] * len(asks), list(asks.values()), use_tqdm=False)
    for rid, out in zip(asks, outs):
        want = streamed[rid]
        got = out.outputs[0]
        assert (got.text, list(got.token_ids), got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason), rid
