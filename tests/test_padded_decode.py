"""Decode padded to batch-size buckets (executor/bucketed_steps.py), run eagerly on the CPU.

The path CUDA graphs replay on a GPU: on every commit here it must equal the unpadded eager path
and HF token for token (full-attention, M-RoPE and hybrid GDN models, batches that need padding,
requests finishing mid-batch), and padding rows must never touch a live KV page or GDN slot.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_engine_parity import MAX_NEW, assert_matches, params, setup_for
from vlmrun import LLM, SamplingParams
from vlmrun.executor import bucketed_steps
from vlmrun.executor.bucketed_steps import bucket_for, batch_buckets


def test_default_is_eager_on_the_cpu_only(qwen3_dir):
    from vlmrun.config import EngineConfig

    assert EngineConfig().enforces_eager(torch.device("cpu")) and not EngineConfig().enforces_eager(torch.device("cuda"))
    assert not EngineConfig(enforce_eager=False).enforces_eager(torch.device("cpu"))
    assert LLM(str(qwen3_dir), dtype="float32", device="cpu").engine.executor.bucketed_steps is None


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[:7] == [1, 2, 4, 8, 16, 24, 32] and batch_buckets(256)[-1] == 256
    assert [bucket_for(n, batch_buckets(20)) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl", "qwen3_5", "qwen3_next"])
def test_padded_decode_equals_eager_and_hf(request, arch):
    """(enforce_eager=False: the CPU pads too.) 3 and 5 requests pad to buckets 4 and 8; shorter max_tokens make requests leave mid-batch,
    so later steps run 4, 3, 2 ... sequences in other buckets."""
    model_dir, cases, expected = setup_for(request, arch)
    names = (list(cases) * 3)[:5]
    limits = [MAX_NEW, 3, MAX_NEW, 6, 1]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=eager, max_num_seqs=8)
        assert (llm.engine.executor.bucketed_steps is None) == eager
        for size in (3, 5):
            sampling = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=5) for n in limits[:size]]
            runs[eager, size] = llm.chat([cases[n] for n in names[:size]], sampling, use_tqdm=False)
    for size in (3, 5):
        for i, (padded, eager) in enumerate(zip(runs[False, size], runs[True, size])):
            assert padded.token_ids == eager.token_ids, f"request {i} of {size}"
            for ours, ref in zip(padded.logprobs, eager.logprobs):
                assert ours.keys() == ref.keys()
                assert max(abs(ours[t] - ref[t]) for t in ours) < 1e-4  # GEMM rounding depends on the row count
            exp = expected[names[i]]
            assert padded.token_ids == exp.token_ids[: limits[i]]
    assert_matches(runs[False, 3][0], expected[names[0]], names[0])  # logprobs vs HF, full length


def snapshot(engine) -> dict[str, torch.Tensor]:
    caches = engine.caches
    state = {f"k{i}": t.clone() for i, t in enumerate(caches.kv_pool.k_buffers)}
    state.update({f"v{i}": t.clone() for i, t in enumerate(caches.kv_pool.v_buffers)})
    if caches.gdn_pool is not None:
        state["conv"] = caches.gdn_pool.conv_state.clone()
        state["rec"] = caches.gdn_pool.recurrent_state.clone()
    return state


def restore(engine, state: dict[str, torch.Tensor]) -> None:
    caches = engine.caches
    for i, t in enumerate(caches.kv_pool.k_buffers):
        t.copy_(state[f"k{i}"])
    for i, t in enumerate(caches.kv_pool.v_buffers):
        t.copy_(state[f"v{i}"])
    if caches.gdn_pool is not None:
        caches.gdn_pool.conv_state.copy_(state["conv"])
        caches.gdn_pool.recurrent_state.copy_(state["rec"])


def live_state_differences(engine) -> list[str]:
    """Run the next (decode) step padded and unpadded from the same state; name every KV slot and
    GDN slot outside the dummy page / dummy slot where the two end states differ, and the sampled tokens if
    they differ. (The real rows'
    own writes differ by GEMM rounding, which depends on the row count: hence the tolerance; a
    padding row writing live state changes it by far more.)"""
    chunks, decodes, _ = engine.scheduler.schedule()
    assert not chunks and len(decodes), "a decode step (plain decodes: one row each)"
    rows = decodes.to_input()
    runner = engine.executor
    before = snapshot(engine)
    padded_tokens = runner.collect_step(runner.launch([], rows))[1].token_ids
    padded = snapshot(engine)
    restore(engine, before)
    runner_padded, runner.bucketed_steps = runner.bucketed_steps, None
    try:
        eager_tokens = runner.collect_step(runner.launch([], rows))[1].token_ids
    finally:
        runner.bucketed_steps = runner_padded
    # (padding that writes a live page may change a live row's tokens in the same step: the KV page's
    # fresh-tail clearing, stale_keys.fresh_tail_slots, then wipes the rest of that page)
    tokens = [] if padded_tokens == eager_tokens else [f"tokens: padded {padded_tokens} != eager {eager_tokens}"]
    return tokens + live_differences(padded, snapshot(engine), engine.caches.plan.page_size)


def live_differences(padded: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], page: int) -> list[str]:
    """Every KV slot outside the dummy page and every GDN slot but the dummy where two snapshots differ."""
    diffs = []
    for name in padded:
        if name in ("conv", "rec"):  # [layers, slots, ...]: slot 0 is the dummy
            changed = ((padded[name] - eager[name]).abs() > 1e-4).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
            diffs += [f"{name} slot {s}" for s in changed if s != 0]
        else:  # [slots, kv_heads, head_dim]: page 0 is the dummy
            changed = ((padded[name] - eager[name]).abs() > 1e-4).flatten(1).any(-1).nonzero().flatten().tolist()
            diffs += [f"{name} slot {s}" for s in changed if s >= page]
    return diffs


def decoding_engine(model_dir):
    """An engine with 3 requests in decode: the next step pads 3 rows to the bucket of 4."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=8, enforce_eager=False)
    engine = llm.engine
    for i, text in enumerate(["A cat.", "The sea is blue and wide.", "Count: one two"]):
        engine.add_request(str(i), engine.process(text), SamplingParams(temperature=0.0, max_tokens=20))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()  # every request has one output token: the next step is a decode of 3
    return engine


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_padding_rows_never_write_live_state(request, arch, monkeypatch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    assert live_state_differences(decoding_engine(model_dir)) == []

    # The check catches padding that writes live state: point the padding rows at live slots.
    assert_live_padding_caught(decoding_engine(model_dir), live_state_differences, monkeypatch)


def assert_live_padding_caught(engine, differences, monkeypatch) -> None:
    """Point the padding at request "0"'s first KV page and GDN slot: `differences(engine)` must name them."""
    live = engine.requests["0"]
    monkeypatch.setattr(bucketed_steps, "PAD_KV_SLOT", live.pages[0] * engine.caches.plan.page_size)
    if engine.caches.gdn_pool is not None:
        monkeypatch.setattr(bucketed_steps, "PAD_GDN_SLOT", live.req_pool_idx + 1)
    diffs = differences(engine)
    assert any(d.startswith("k") for d in diffs), diffs
    if engine.caches.gdn_pool is not None:
        assert any(d.startswith(("conv", "rec")) for d in diffs), diffs
