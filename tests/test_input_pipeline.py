"""The input pipeline behind `LLM.generate` / `LLM.chat` (`vlmrun/feed/`): lazy inputs, bounded prefetch,
preprocessing overlapped with the engine's steps, results in input order, a bad input failing alone."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

from vlmrun import LLM, SamplingParams
from vlmrun.feed.reorder import ReorderWindow
from vlmrun.feed.workers import cgroup_cpu_quota, preprocess_workers, usable_cpus

PREFETCH = 3
WORKERS = 2
MAX_SEQS = 2
N = 24


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir: Path) -> LLM:
    return LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_num_seqs=MAX_SEQS,
               preprocess_workers=WORKERS, preprocess_prefetch=PREFETCH)


def image(i: int) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8))


def prompts(n: int, read: list[int] | None = None) -> Iterator[dict[str, Any]]:
    """A generator of n image prompts; `read` counts how many were taken from it."""
    for i in range(n):
        if read is not None:
            read[0] += 1
        yield {"prompt": f"Describe picture {i}.", "images": [image(i)]}


class Watch:
    """Counts the processed prompts alive (made by `engine.process`, not yet freed) and what had been
    processed when the engine's first step began."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch):
        self.alive: list[weakref.ref] = []
        self.most_alive = 0
        self.processed = 0
        self.processed_at_first_step: int | None = None
        self.lock = threading.Lock()
        process, step = llm.engine.process, llm.engine.step

        def counting_process(prompt: Any) -> Any:
            out = process(prompt)
            with self.lock:
                self.processed += 1
                self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(out)]
                if len(self.alive) > self.most_alive:
                    gc.collect()  # only a true high-water mark counts (cycles freed)
                    self.alive = [r for r in self.alive if r() is not None]
                    self.most_alive = max(self.most_alive, len(self.alive))
            return out

        def first_step_watch() -> Any:
            if self.processed_at_first_step is None:
                self.processed_at_first_step = self.processed
            return step()

        monkeypatch.setattr(llm.engine, "process", counting_process)
        monkeypatch.setattr(llm.engine, "step", first_step_watch)


def test_generate_over_a_generator_holds_at_most_the_prefetch(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch(llm, monkeypatch)
    read = [0]
    outs = llm.generate(prompts(N, read), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outs) == N and all(o.error is None and o.outputs for o in outs)
    assert read[0] == N and watch.processed == N
    # ahead of the engine: at most PREFETCH; in it: at most MAX_SEQS (today's code: all N at once)
    assert watch.most_alive <= PREFETCH + MAX_SEQS + 1, watch.most_alive
    # the first step ran once the first inputs were ready, not after the last (today's: after all N)
    assert watch.processed_at_first_step is not None
    assert watch.processed_at_first_step <= PREFETCH + MAX_SEQS + WORKERS, watch.processed_at_first_step


def test_outputs_are_those_of_one_call_per_prompt_in_input_order(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=1 + (7 * i) % 5) for i in range(8)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(prompts(8), params)]
    outs = llm.generate(prompts(8), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone
    assert [int(o.request_id) for o in outs] == sorted(int(o.request_id) for o in outs)


def test_a_bad_input_in_the_middle_fails_alone(llm: LLM) -> None:
    items = list(prompts(5))
    items[2] = {"prompt": "Describe.", "images": [b"not an image"]}
    streamed = dict(llm.generate_stream(iter(items), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False))
    assert sorted(streamed) == list(range(5))
    assert streamed[2].error is not None and "image" in streamed[2].error and not streamed[2].outputs
    good = [streamed[i] for i in (0, 1, 3, 4)]
    assert all(o.error is None and o.outputs for o in good)
    listed = llm.generate(items, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.error is None for o in listed] == [True, True, False, True, True]
    assert [o.token_ids for o in listed] == [streamed[i].token_ids for i in range(5)]


def test_generate_stream_hands_out_results_as_they_finish_with_their_index(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    order = [index for index, _ in llm.generate_stream(["One two three.", "Four."], params, use_tqdm=False)]
    assert order == [1, 0]  # the short one finished first


def test_leaving_a_stream_early_aborts_its_requests(llm: LLM) -> None:
    stream = llm.generate_stream(prompts(10), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(["again"], SamplingParams(max_tokens=1), use_tqdm=False)[0].token_ids) == 1


def test_a_generator_raising_midway_raises_from_generate(llm: LLM) -> None:
    def broken() -> Iterator[str]:
        yield "fine"
        raise RuntimeError("the manifest broke")

    with pytest.raises(RuntimeError, match="the manifest broke"):
        llm.generate(broken(), SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_chat_takes_a_generator_of_conversations(llm: LLM) -> None:
    convs = ([{"role": "user", "content": f"Say {w}."}] for w in ("yes", "no"))
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    listed = llm.chat([[{"role": "user", "content": f"Say {w}."}] for w in ("yes", "no")],
                      SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in listed]


# ------------------------------------------------------------------ pieces


def test_reorder_window_releases_in_order_and_bounds_what_it_holds() -> None:
    window: ReorderWindow[str] = ReorderWindow(3)
    slots = [window.open() for _ in range(3)]
    assert window.full
    with pytest.raises(ValueError):
        window.open()
    window.close(slots[2], "c")
    window.close(slots[1], "b")
    assert list(window.released()) == []  # slot 0 is still open
    window.close(slots[0], "a")
    assert list(window.released()) == ["a", "b", "c"] and len(window) == 0
    d = window.open()
    window.close(d, "d")
    assert list(window.released()) == ["d"]
    with pytest.raises(ValueError):
        window.close(d, "again")


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.max").write_text("150000 100000\n")
    own = tmp_path / "self_cgroup"
    own.write_text("0::/job\n")
    assert cgroup_cpu_quota(v2, own) == 1.5
    (v2 / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2, own) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "docker").mkdir(parents=True)
    (v1 / "cpu" / "docker" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("4:cpu,cpuacct:/docker\n")
    assert cgroup_cpu_quota(v1, own) == 3.0


def test_worker_count_follows_the_cpus_this_process_may_use() -> None:
    assert 1 <= usable_cpus() <= max(1, len(__import__("os").sched_getaffinity(0)))
    assert preprocess_workers(limit=1) == 1
    assert preprocess_workers() == min(8, usable_cpus())


def test_a_list_of_params_that_does_not_match_a_generator_raises(llm: LLM) -> None:
    with pytest.raises(ValueError, match="more sampling params than prompts"):
        llm.generate((p for p in ["a"]), [SamplingParams(max_tokens=1)] * 2, use_tqdm=False)
    with pytest.raises(ValueError, match="fewer sampling params than prompts"):
        llm.generate((p for p in ["a", "b"]), [SamplingParams(max_tokens=1)], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):  # a list: before anything runs
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1)], use_tqdm=False)


def test_the_bar_counts_finished_inputs_with_both_rates(capsys: pytest.CaptureFixture) -> None:
    from vlmrun.feed.progress import FeedProgress

    bar = FeedProgress(total=3)
    for tokens, preprocessed in ((4, 2), (4, 3), (2, 3)):
        bar.advance(tokens, preprocessed)
    bar.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "input/s" in err and "prep " in err and "tok/s" in err and bar.tokens == 10


def test_a_call_that_fits_the_prefetch_is_added_at_once_in_input_order(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    """A list of at most `preprocess_prefetch` inputs runs as one batch added before the first step, in
    input order, however the workers finish (here the first input is the slowest): its schedule does not
    depend on thread timing."""
    process, step = llm.engine.process, llm.engine.step
    added: list[str] = []
    add = llm.engine.add_request
    added_before_first_step: list[list[str]] = []

    def slow_first(prompt: Any) -> Any:
        if "picture 0." in repr(prompt):
            threading.Event().wait(0.3)
        return process(prompt)

    def recording_add(request_id, *args, **kwargs):
        added.append(request_id)
        return add(request_id, *args, **kwargs)

    def recording_step():
        if not added_before_first_step:
            added_before_first_step.append(list(added))
        return step()

    monkeypatch.setattr(llm.engine, "process", slow_first)
    monkeypatch.setattr(llm.engine, "add_request", recording_add)
    monkeypatch.setattr(llm.engine, "step", recording_step)
    outs = llm.generate(list(prompts(PREFETCH)), SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.error for o in outs] == [None] * PREFETCH
    (first,) = added_before_first_step
    assert [rid.split("-")[0] for rid in first] == sorted((rid.split("-")[0] for rid in first), key=int)
    assert len(first) == PREFETCH  # all of them, beyond max_num_seqs (2): they wait in the engine's queue
