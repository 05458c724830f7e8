"""The runner's persistent per-row sampling state (vlmrun/layers/sampling_state.py).

A step's batch gathered from the state equals `SamplingBatch.build`'s for the same rows, field for field,
over random mixes of settings, steps and requests changing rows; the runner samples the same tokens
with it, and a penalty row's step touches none of its 2,000-token history on the host once it is built;
penalties with rows reused and requests preempted give the same tokens synchronous and async, and the
same as each request alone.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from vlmrun.cache.plan import kv_bytes_per_token
from vlmrun.config import CacheShape, EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.executor.model_runner import LaunchedStep, ModelRunner
from vlmrun.executor.step_features import HostDrafts
from vlmrun.executor.step_input import ChunkInput, DecodeRows
from vlmrun.layers.sampler import Sampler
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.layers.sampling_state import SamplingState, emitted_positions
from vlmrun.sampling_params import SamplingParams
from vlmrun.spec_decode.verify import position_rows as position_rows_of

VOCAB = 64


def random_params(rng: random.Random) -> SamplingParams:
    """Any mix: greedy or sampled, truncation, penalties, logprobs, min_tokens, bad words, allowed ids, bias."""
    kw: dict = dict(temperature=rng.choice([0.0, 0.7, 1.3]))
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([1, 5, 200])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        kw["min_p"] = 0.1
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([1.2, 0.8])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = 0.5
    if rng.random() < 0.3:
        kw["presence_penalty"] = -0.3
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        kw["min_tokens"] = 3
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), 10)
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(VOCAB): 2.5, rng.randrange(VOCAB): -1.0}
    params = SamplingParams(**kw)
    if rng.random() < 0.2:
        params.bad_words_token_ids = [[rng.randrange(VOCAB)], [5, rng.randrange(VOCAB)]]
    return params


def assert_same_batch(got: SamplingBatch, want: SamplingBatch) -> None:
    for f in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f.name
        elif f.name == "generators":
            assert len(a) == len(b) and all(x is y for x, y in zip(a, b)), f.name
        else:
            assert a == b, f.name


def gather_and_sample(state: SamplingState, sampler: Sampler, page_rows: list[int], rows: list[SamplingRow]) -> None:
    """One step: the gathered batch equals `build`'s; its sampled tokens recorded and appended to the outputs."""
    step = state.gather(page_rows, rows, VOCAB)
    assert_same_batch(step.batch, SamplingBatch.build(rows, VOCAB))
    tokens = sampler.sample(torch.randn(len(rows), VOCAB), step.batch).token_ids
    state.record(step, tokens)
    for row, token in zip(rows, tokens.tolist()):
        row.output_token_ids.append(token)


@pytest.mark.parametrize("seed", range(6))
def test_gathered_batch_equals_build_over_steps(seed: int) -> None:
    """Requests come, sample for a few steps and go; rows are reused (some by requests sharing a params
    object); each step's gathered batch equals `build`'s, the counts recorded on the device included."""
    rng = random.Random(seed)
    state, sampler = SamplingState(num_rows=9, device="cpu"), Sampler(torch.Generator().manual_seed(seed))
    shared = random_params(rng)
    live: dict[int, SamplingRow] = {}
    for _ in range(8):
        for row in list(live):
            if rng.random() < 0.25:
                del live[row]  # finished: its row is free
        for row in range(9):
            if row not in live and rng.random() < 0.5:
                params = shared if rng.random() < 0.3 else random_params(rng)
                generator = torch.Generator().manual_seed(rng.randrange(99)) if rng.random() < 0.4 else None
                prompt = [rng.randrange(VOCAB + 4) for _ in range(rng.randrange(1, 12))]  # some ids past the vocab
                outputs = [rng.randrange(VOCAB) for _ in range(rng.randrange(3))]  # (a preempted request's)
                live[row] = SamplingRow(params, prompt, outputs, generator, [1, 2])
        if not live:
            continue
        page_rows = rng.sample(sorted(live), len(live))  # the step's order
        rows = [live[r] for r in page_rows]
        gather_and_sample(state, sampler, page_rows, rows)


def test_a_rows_list_gathered_again_skips_the_per_row_check() -> None:
    """The decode table hands a steady step the same list of sampling rows (`DecodeTable.columns_of`): gathered
    again with the same page rows, what each row holds is not checked again (`_admit` is not called), and the
    batch is still `build`'s; a new list, or other page rows, is checked."""
    rng = random.Random(5)
    state, sampler = SamplingState(num_rows=6, device="cpu"), Sampler(torch.Generator().manual_seed(5))
    rows = [SamplingRow(random_params(rng), [rng.randrange(VOCAB) for _ in range(4)], [],
                        torch.Generator().manual_seed(i) if i % 2 else None, [1]) for i in range(5)]
    page_rows = [4, 0, 2, 1, 3]
    admitted: list[int] = []
    admit = state._admit
    state._admit = lambda *args: (admitted.append(len(args[0])), admit(*args))[1]  # (an observer: it calls through)
    for step in range(4):
        gather_and_sample(state, sampler, page_rows, rows)
        assert admitted == [5], step  # the first gather only
    state.gather([3, 0, 2, 1, 4], rows, VOCAB)  # the same list (the one gathered last) at other rows: checked
    state.gather([3, 0, 2, 1, 4], list(rows), VOCAB)  # another list: checked
    assert admitted == [5, 5, 5]


def test_row_taken_by_another_request_with_the_same_params_and_as_many_outputs() -> None:
    """Request A (penalties) samples once in row 0 and leaves; B, sharing A's params object and back from a
    preemption with as many outputs, takes the row: B's counts are B's, not A's."""
    state = SamplingState(num_rows=2, device="cpu")
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)
    a = SamplingRow(params, [1, 2, 3], [], None, [0])
    step = state.gather([0], [a], VOCAB)
    state.record(step, torch.tensor([9]))
    a.output_token_ids.append(9)
    b = SamplingRow(params, [4, 5], [11], None, [0])
    assert_same_batch(state.gather([0], [b], VOCAB).batch, SamplingBatch.build([b], VOCAB))


def test_counts_rebuilt_after_tokens_the_state_did_not_record() -> None:
    """A speculative verify step samples with `SamplingBatch.build` and records nothing; the row's outputs
    grew by the accepted drafts and the bonus token: its next gathered step rebuilds the counts."""
    state = SamplingState(num_rows=4, device="cpu")
    row = SamplingRow(SamplingParams(temperature=0.5, repetition_penalty=1.2, presence_penalty=0.7), [3, 4], [], None, [0])
    state.record(state.gather([2], [row], VOCAB), torch.tensor([8]))
    row.output_token_ids.append(8)
    state.gather([2], [row], VOCAB)  # current: nothing rebuilt, nothing recorded
    row.output_token_ids.extend([9, 9, 10])  # a verify step's emitted tokens
    assert_same_batch(state.gather([2], [row], VOCAB).batch, SamplingBatch.build([row], VOCAB))


@pytest.mark.parametrize("seed", range(4))
def test_verify_steps_gather_positions_and_record_the_emitted_tokens(seed: int) -> None:
    """Speculative verification: each request's row at its 1 + d positions, drafts[:j] appended at position
    j, equals `build` over `position_rows`; the counts then take only the emitted tokens (the first
    1 + accepted), so the next step, drafts or not, equals `build` again."""
    rng = random.Random(seed)
    state, sampler = SamplingState(num_rows=6, device="cpu"), Sampler(torch.Generator().manual_seed(seed))
    rows = {r: SamplingRow(random_params(rng), [rng.randrange(VOCAB) for _ in range(8)], [], None, [1])
            for r in (1, 3, 4)}
    for _ in range(6):
        page, drafts = list(rows), {r: [rng.randrange(VOCAB) for _ in range(rng.randrange(3))] for r in rows}
        position_rows = [p for r in page for p in position_rows_of(rows[r], drafts[r])]
        spans = [1 + len(drafts[r]) for r in page]
        step = state.gather([r for r, k in zip(page, spans) for _ in range(k)], position_rows, VOCAB,
                            appended=[drafts[r][:j] for r, k in zip(page, spans) for j in range(k)])
        assert_same_batch(step.batch, SamplingBatch.build(position_rows, VOCAB))
        tokens = sampler.sample(torch.randn(len(position_rows), VOCAB), step.batch).token_ids
        accepted = [rng.randrange(k) for k in spans]  # (as the runner would find them, any count will do)
        state.record(step, tokens, emitted_positions(torch.tensor(accepted), spans, torch.device("cpu")))
        first = 0
        for r, k, a in zip(page, spans, accepted):
            rows[r].output_token_ids.extend(tokens[first:first + 1 + a].tolist())
            first += k


class Model(nn.Module):
    """Logits are the hidden states times a fixed matrix: the runner's `sample` is all that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, VOCAB, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


class CountedTokens(list):
    """A token list that counts the items the host reads from it (iteration, indexing, slicing)."""

    read = 0

    def __iter__(self):
        CountedTokens.read += len(self)
        return super().__iter__()

    def __getitem__(self, key):
        item = super().__getitem__(key)
        CountedTokens.read += len(item) if isinstance(key, slice) else 1
        return item


def make_runner() -> ModelRunner:
    torch.manual_seed(0)
    caches = SimpleNamespace(req_to_token=SimpleNamespace(max_reqs=8), gdn_pool=None)
    return ModelRunner(Model(), caches, attn_backend=None, vision=None, device=torch.device("cpu"), seed=3)


def test_runner_penalty_rows_cost_nothing_per_token_of_history() -> None:
    """A 2,000-token prompt with penalties: after the step that builds its row, no step reads its history
    on the host; the tokens equal `build` + `Sampler` over the same rows (the runner's generator order)."""
    runner = make_runner()
    reference = Sampler(torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.9, presence_penalty=0.4, top_k=7),
              SamplingParams(temperature=0.8, seed=4)]
    prompts = [CountedTokens(random.Random(i).choices(range(VOCAB), k=2000)) for i in range(3)]
    outputs = [CountedTokens() for _ in range(3)]
    rows = [SamplingRow(p, prompt, out, runner.make_generator(4) if p.seed is not None else None)
            for p, prompt, out in zip(params, prompts, outputs)]
    ref_rows = [r._replace(generator=torch.Generator().manual_seed(4) if r.generator is not None else None)
                for r in rows]
    hidden = torch.randn(12, 3, 8)
    for step_i in range(12):
        CountedTokens.read = 0
        decodes = DecodeRows(rows=[5], starts=[0], token_ids=[0], kv_slots=torch.zeros(1, dtype=torch.int64),
                             sampling=[rows[2]])  # a plain decode row first, then two chunks
        chunks = [ChunkInput(row=r, start=0, token_ids=[0], positions=None, kv_slots=torch.zeros(1, dtype=torch.int64),
                             mm_items=(), sampling=row) for r, row in zip([2, 7], rows[:2])]
        step = LaunchedStep([True, True], None, [None, None], drafts=HostDrafts(chunks))
        runner.sample(step, chunks, decodes, hidden[step_i], SimpleNamespace(logits_indices=torch.arange(3)))
        if step_i:
            assert CountedTokens.read == 0, step_i
        want = reference.sample(runner.model.compute_logits(hidden[step_i]),
                                SamplingBatch.build([ref_rows[2], *ref_rows[:2]], VOCAB))
        got = step.output.token_ids.tolist()
        assert got == want.token_ids.tolist(), step_i
        for out, token in zip([outputs[2], outputs[0], outputs[1]], got):
            list.append(out, token)


def run_engine(model_dir, requests, async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
    """Three rows, KV for 6 pages of 16 tokens (+ a page): fewer than three requests' whole lengths."""
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=3,
                                 max_num_batched_tokens=48, page_size=16,
                                 kv_cache_memory_bytes=7 * 16 * kv_bytes_per_token(shape, torch.float32),
                                 async_scheduling=async_scheduling, seed=7))
    try:
        for name, ids, params in requests:
            engine.add_request(name, engine.process({"prompt_token_ids": ids}), params)
        results = {}
        while engine.has_unfinished():
            for update in engine.step():
                if update.finished:
                    results[update.request_id] = update.result.token_ids
        return results, engine.stats().num_preemptions
    finally:
        engine.shutdown()


def test_penalties_with_rows_reused_async_equals_sync_equals_alone(qwen3_dir) -> None:
    """Seven penalty requests (four sharing one params object) through three rows: rows change hands and
    requests are preempted; each request's tokens are those it gets alone, synchronous and async."""
    shared = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.6, presence_penalty=0.2)
    params = [shared, shared, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=0.7),
              shared, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, frequency_penalty=1.5),
              shared, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    requests = [(f"r{i}", [(5 * i + 3 * j) % 90 + 4 for j in range(20 + 3 * i)], p) for i, p in enumerate(params)]
    alone = {name: run_engine(qwen3_dir, [(name, ids, p)], False)[0][name] for name, ids, p in requests}
    sync, preemptions = run_engine(qwen3_dir, requests, False)
    ahead, _ = run_engine(qwen3_dir, requests, True)
    assert preemptions > 0
    assert sync == alone
    assert ahead == alone


def test_penalty_requests_decode_as_rows(qwen3_dir) -> None:
    """With their counts kept per row, requests with penalties, bad words, a bias or allowed ids decode as
    plain decode rows (`DecodeRows`), not as a chunk each; min_tokens (counted with placeholders) stays a chunk."""
    engine = Engine(EngineConfig(model=str(qwen3_dir), device="cpu", dtype="float32", max_num_seqs=8,
                                 max_num_batched_tokens=64, kv_cache_memory_bytes=16 * 1024 * 1024))
    params = [SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=4, frequency_penalty=0.5, logit_bias={3: 1.0},
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[3, 4, 5], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2)]
    launch, row_ids = engine.executor.launch, []  # the request ids the runner is given as decode rows

    def counting(chunks, decodes=None):
        if decodes is not None:
            row_ids.extend(r.request_id for r in engine.scheduler.running if r.req_pool_idx in decodes.rows)
        return launch(chunks, decodes) if decodes is not None else launch(chunks)

    engine.executor.launch = counting
    try:
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", engine.process({"prompt_token_ids": [5 + i, 9, 13, 17]}), p)
        assert [engine.scheduler.waiting[i].plain_decode for i in range(4)] == [True, True, True, False]
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.shutdown()
    # each of the first three decoded as rows (EOS ignored: 3 decode steps each); min_tokens never did
    assert {"r0", "r1", "r2"} <= set(row_ids) and "r3" not in row_ids, row_ids
