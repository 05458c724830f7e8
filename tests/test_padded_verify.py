"""Speculative decoding's verify steps padded to a bucket (executor/bucketed_steps.py), run eagerly on the CPU.

With `enforce_eager=False` a verify step (every sequence feeds its last token and at most k drafts)
runs as b rows of exactly 1 + k positions: the shape a CUDA graph is captured for. Here it must give
plain decode's tokens (n-gram drafts of varied lengths on a full-attention and a hybrid model, MTP
drafts on a hybrid one), really run padded, and its padding (positions at the end of a row with
fewer drafts, whole padding rows) must never touch a live KV page or GDN slot: one verify step run
padded and unpadded from the same state leaves the same live state, and padding pointed at a live
slot on purpose is caught.
"""

from __future__ import annotations

import pytest

from tests.test_async_scheduling import assert_same, engine_options
from tests.test_padded_decode import assert_live_padding_caught, live_differences, restore, snapshot
from tests.test_spec_decode import SPEC, run, spec_scenario
from tests.test_spec_decode_mtp import MTP, generate, mtp_dirs  # noqa: F401 (a fixture)
from vlmrun import LLM, SamplingParams
from vlmrun.executor.bucketed_steps import BucketedStepInputs


@pytest.fixture
def padded_verify_steps(monkeypatch) -> list[tuple[int, int]]:
    """Records (real sequences, bucket) of every verify step that runs padded."""
    steps: list[tuple[int, int]] = []
    fill = BucketedStepInputs.fill_verify

    def recording(self, fb, bucket):
        steps.append((fb.batch_size, bucket))
        return fill(self, fb, bucket)

    monkeypatch.setattr(BucketedStepInputs, "fill_verify", recording)
    return steps


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_ngram_verify_steps_run_padded(request, arch, padded_verify_steps):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = spec_scenario(False)
    plain, _ = run(model_dir, prompts, params, None, enforce_eager=False)
    spec, _ = run(model_dir, prompts, params, SPEC, enforce_eager=False)
    assert_same(plain, spec)
    assert padded_verify_steps and any(n < bucket for n, bucket in padded_verify_steps)


def test_mtp_verify_steps_run_padded(mtp_dirs, padded_verify_steps):
    model_dir = mtp_dirs["qwen3_next"]
    prompts, params = spec_scenario(False)
    plain, _ = generate(model_dir, prompts, params, None, enforce_eager=False)
    spec, _ = generate(model_dir, prompts, params, MTP, enforce_eager=False)
    assert_same(plain, spec)
    assert padded_verify_steps


PROMPTS = ["one two three four one two three four one two three", "A cat sat.", "x y x y x y x y x"]
NUM_DRAFTS = [3, 0, 2]  # per prompt: rows padded inside (0 and 2 drafts of k = 3) and one full row


class FixedDrafts:
    """Proposes NUM_DRAFTS[i] drafts (token 7, mostly rejected: rejected positions must leave no trace
    either) for the request whose context starts with PROMPTS[i]'s tokens."""

    drafts_on_device = False
    drafts_grammar_rows = True

    def __init__(self, prompt_ids: list[list[int]]):
        self.prompt_ids = prompt_ids

    def forget(self, key: object) -> None:
        """Nothing is kept per request."""

    def propose(self, token_ids: list[int], max_drafts: int, key: object = None) -> list[int]:
        i = next(i for i, ids in enumerate(self.prompt_ids) if token_ids[:len(ids)] == ids)
        return [7] * min(NUM_DRAFTS[i], max_drafts)


def verifying_engine(model_dir):
    """3 requests decoding with drafts: the next step is a verify step padded to a bucket of 4."""
    llm = LLM(str(model_dir), **engine_options(model_dir, speculative_config=SPEC, enforce_eager=False,
                                                max_num_seqs=8))
    engine = llm.engine
    prompts = [engine.process(text) for text in PROMPTS]
    engine.scheduler.proposer = FixedDrafts([p.token_ids for p in prompts])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    return engine


def live_state_differences(engine) -> list[str]:
    """Run the next (verify) step padded and unpadded from the same state; name every KV slot outside
    the dummy page and every GDN slot but the dummy where the two end states differ, and the sampled tokens if they differ (GEMM rounding
    depends on the row count: hence the tolerance; padding writing live state changes far more)."""
    chunks, _, _ = engine.scheduler.schedule()  # (speculating: no plain decode rows)
    inputs = [c.to_input() for c in chunks]
    assert [c.num_drafts for c in inputs] == NUM_DRAFTS
    runner = engine.executor
    before = snapshot(engine)
    padded_tokens = [[s.sampled.token_id] + [t.token_id for t in s.after_drafts] for s in runner.execute(inputs)]
    padded = snapshot(engine)
    restore(engine, before)
    runner_padded, runner.bucketed_steps = runner.bucketed_steps, None
    try:
        eager_tokens = [[s.sampled.token_id] + [t.token_id for t in s.after_drafts] for s in runner.execute(inputs)]
    finally:
        runner.bucketed_steps = runner_padded
    # (padding that writes a live page may change a live row's tokens in the same step: the KV page's
    # fresh-tail clearing, stale_keys.fresh_tail_slots, then wipes the rest of that page)
    tokens = [] if padded_tokens == eager_tokens else [f"tokens: padded {padded_tokens} != eager {eager_tokens}"]
    return tokens + live_differences(padded, snapshot(engine), engine.caches.plan.page_size)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_verify_padding_never_writes_live_state(request, arch, monkeypatch, padded_verify_steps):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    assert live_state_differences(verifying_engine(model_dir)) == []
    assert padded_verify_steps[-1] == (3, 4)

    # The check catches padding that writes live state: point the padding at live slots.
    assert_live_padding_caught(verifying_engine(model_dir), live_state_differences, monkeypatch)
