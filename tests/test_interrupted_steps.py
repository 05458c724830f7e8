"""A step either completes or leaves no trace (issue 29): a `KeyboardInterrupt` or an exception in the
middle of a step, of `LLM.generate` or of `LLM.chat` aborts that call's requests and frees them; no
half-advanced GDN state is saved as a prefix-cache snapshot; the engine stays usable and exact. And
`LLM` serialises calls from several threads.

The interrupt is raised from inside the model: after a chosen GDN (or full-attention) layer ran its
forward for a chosen step, so the layers before it have written their state in place.
"""

from __future__ import annotations

import threading

import pytest
import torch

from vlmrun import LLM, SamplingParams
from vlmrun.models.blocks.hybrid_decoder import HybridDecoderLayer

PROMPT = ("Describe the picture: a small red circle left of a large blue square, a green triangle above "
          "them, two yellow stars near the top right corner and a purple line along the bottom edge.")


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


def make_llm(model_dir, async_scheduling: bool = False) -> LLM:
    # 16-token chunks and pages, a snapshot every 32 tokens: the prompt runs in several prefill chunks
    return LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=16, page_size=16,
               prefix_snapshot_interval=32, gdn_prefix_snapshots=8, max_num_seqs=4, async_scheduling=async_scheduling)


class InterruptAt:
    """Raise `error` after `layer`'s forward the `call`-th time it runs (1-based), once."""

    def __init__(self, layer: torch.nn.Module, call: int, error: BaseException):
        self.layer, self.call, self.error, self.calls = layer, call, error, 0
        self.real = layer.forward
        layer.forward = self.forward

    def forward(self, *args, **kwargs):
        out = self.real(*args, **kwargs)
        self.calls += 1
        if self.calls == self.call:
            self.layer.forward = self.real
            raise self.error
        return out


def first_gdn_layer(llm: LLM) -> torch.nn.Module:
    return next(m for m in llm.engine.executor.model.modules() if isinstance(m, HybridDecoderLayer) and m.is_gdn)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert stats.num_running == stats.num_waiting == stats.req_rows_used == 0


def same_output(a, b) -> None:
    assert a.error is None and b.error is None
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-5


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")], ids=["ctrl-c", "exception"])
@pytest.mark.parametrize("call", [1, 2, 3, 7])  # first chunk, later prefill chunks, a decode step
def test_an_interrupted_step_poisons_nothing(qwen3_5_dir, error, call, async_scheduling):
    """Under async scheduling the step that raises runs on the engine's worker thread while the next
    one may already be launched: both are waited for and their requests aborted."""
    reference = make_llm(qwen3_5_dir).generate([PROMPT], greedy(), use_tqdm=False)[0]
    llm = make_llm(qwen3_5_dir, async_scheduling)
    InterruptAt(first_gdn_layer(llm), call, error)
    with pytest.raises(type(error)):
        llm.generate([PROMPT, PROMPT + " Twice."], greedy(), use_tqdm=False)
    assert_idle(llm)  # the call's requests were aborted and freed, none leaks into the next call
    for _ in range(2):  # the second run may hit the prefix cache the first one filled
        same_output(llm.generate([PROMPT], greedy(), use_tqdm=False)[0], reference)
    assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("call", [2, 3])
def test_an_engine_step_that_raises_aborts_its_requests(qwen3_5_dir, call, async_scheduling):
    """The engine alone (no LLM call around it to clean up): the interrupted request is gone, the
    engine goes on, and a later identical prompt computes (or hits the cache) exactly."""
    reference = make_llm(qwen3_5_dir).generate([PROMPT], greedy(), use_tqdm=False)[0]
    llm = make_llm(qwen3_5_dir, async_scheduling)
    engine = llm.engine
    engine.add_request("victim", engine.process(PROMPT), greedy())
    InterruptAt(first_gdn_layer(llm), call, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished():
            engine.step()
    assert "victim" not in engine.requests and not engine.has_unfinished()
    for _ in range(2):
        same_output(llm.generate([PROMPT], greedy(), use_tqdm=False)[0], reference)


def test_an_interrupt_in_chat_aborts_that_call(qwen3_5_dir):
    llm = make_llm(qwen3_5_dir)
    InterruptAt(first_gdn_layer(llm), 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.chat([{"role": "user", "content": PROMPT}], greedy(), use_tqdm=False)
    assert_idle(llm)
    assert llm.chat([{"role": "user", "content": PROMPT}], greedy(), use_tqdm=False)[0].error is None


def test_threads_share_one_llm_serialised(qwen3_5_dir):
    llm = make_llm(qwen3_5_dir)
    prompts = [f"{PROMPT} Number {k}." for k in range(4)]
    expected = {p: out.text for p, out in zip(prompts, llm.generate(prompts, greedy(8), use_tqdm=False))}
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(prompt: str) -> None:
        try:
            for _ in range(2):
                results[prompt] = llm.generate([prompt], greedy(8), use_tqdm=False)[0].text
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == expected
    assert_idle(llm)


def test_a_ctrl_c_while_waiting_for_the_launched_step_is_raised(qwen3_5_dir):
    """Async scheduling: a step fails while another is launched; the engine waits for the launched steps
    before dropping their requests. A Ctrl-C during that wait is raised (not swallowed as the failure's
    cleanup), and every request of the steps is dropped."""
    llm = make_llm(qwen3_5_dir, async_scheduling=True)
    engine = llm.engine
    engine.add_request("victim", engine.process(PROMPT), greedy())
    InterruptAt(first_gdn_layer(llm), 2, RuntimeError("the model failed"))
    real_collect, real_drop, dropping = engine.executor.collect, engine._drop_interrupted, []

    def drop(steps):  # the cleanup after the failure
        dropping.append(len(steps))
        return real_drop(steps)

    def collect(handle):  # a Ctrl-C arrives while the cleanup waits
        if dropping:
            engine.executor.collect = real_collect
            raise KeyboardInterrupt
        return real_collect(handle)

    engine._drop_interrupted, engine.executor.collect = drop, collect
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished():
            engine.step()
    assert dropping and engine.executor.collect is real_collect
    assert "victim" not in engine.requests and not engine.has_unfinished()
    assert_idle(llm)
