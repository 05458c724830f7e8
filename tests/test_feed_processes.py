"""Preprocessing in worker processes (`vlmrun/feed/process_workers.py`, `preprocess_pool="process"`):
the prompts the threads make, a crash failing only its input, no process left behind (issue 47)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from vlmrun import LLM, SamplingParams
from vlmrun.feed.pipeline import InputPipeline, Work
from vlmrun.feed.prepare import GeneratePrepare
from vlmrun.feed.process_workers import WorkerProcess
from vlmrun.feed.workers import PROCESS_MIN_INPUTS, worker_pool
from vlmrun.processors import ProcessedPrompt

ROOT = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir: Path) -> LLM:
    return LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_num_seqs=4, preprocess_workers=1,
               preprocess_pool="thread")


def image(i: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, size=(40, 56, 3), dtype=np.uint8))


def spawned_children() -> list[psutil.Process]:
    """This process's worker processes (multiprocessing's resource tracker, which lives as long as we do, left out)."""
    return [c for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())]


def same_prompt(a: ProcessedPrompt, b: ProcessedPrompt) -> bool:
    return (a.token_ids == b.token_ids and a.text == b.text and len(a.mm_items) == len(b.mm_items)
            and all(x.hash == y.hash and x.offset == y.offset and tuple(x.grid_thw) == tuple(y.grid_thw)
                    and torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a.mm_items, b.mm_items)))


def test_a_worker_process_makes_the_prompts_a_thread_makes(llm: LLM) -> None:
    prompts: list[Any] = [{"prompt": "Describe it.", "images": [image(1)]},
                          [{"role": "user", "content": [{"type": "image", "image": image(2)},
                                                        {"type": "text", "text": "What is this?"}]}],
                          {"prompt": "raw text, no template"}]
    kwargs = {"max_pixels": 8192}
    worker, sized = WorkerProcess(GeneratePrepare(llm.engine.processor)), WorkerProcess(
        GeneratePrepare(llm.engine.processor, kwargs))
    try:
        for prompt in prompts:
            assert same_prompt(worker.run(prompt), llm.engine.process(prompt))
            assert same_prompt(sized.run(prompt), llm._processing(kwargs)(prompt))
        if os.path.isdir("/proc/self/fd"):  # prompts held hold no shared-memory descriptor (copied out)
            before = len(os.listdir("/proc/self/fd"))
            held = [worker.run(prompts[0]) for _ in range(8)]
            assert len(os.listdir("/proc/self/fd")) - before < 4 and len(held) == 8
    finally:
        worker.close()
        sized.close()
    assert not spawned_children()


def test_generate_with_process_workers_gives_the_threads_outputs(llm: LLM) -> None:
    prompts = [{"prompt": f"Picture {i}.", "images": [image(i)]} for i in range(3)] + [
        {"prompt": "Broken.", "images": [b"not an image"]}]
    threads = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.preprocess_pool = "process"
    try:
        processes = llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        llm.preprocess_pool = "thread"
    assert [(o.prompt_token_ids, o.token_ids, o.error) for o in processes] == [
        (o.prompt_token_ids, o.token_ids, o.error) for o in threads]
    assert processes[3].error is not None and "image" in processes[3].error
    assert not spawned_children()  # the call's processes are gone with it


class CrashOn:
    """A prepare whose process dies (as a decoder's segfault would) on the input `crash`."""

    def __init__(self, inner: GeneratePrepare):
        self.inner = inner

    def __call__(self, prompt: Any) -> ProcessedPrompt:
        if prompt == "crash":
            os._exit(7)
        return self.inner(prompt)


def test_a_worker_process_that_dies_fails_only_its_input_and_is_replaced(llm: LLM) -> None:
    portable = CrashOn(GeneratePrepare(llm.engine.processor))
    pipeline = InputPipeline(llm.engine, llm.engine.process, workers=1, prefetch=2, pool="process", portable=portable)
    sources = ["first", "crash", "third", "fourth"]
    works = [Work(f"c{i}", s, [PARAMS]) for i, s in enumerate(sources)]
    done = {f.index: f for f in pipeline.stream(works)}
    assert sorted(done) == [0, 1, 2, 3]
    assert "worker process died" in done[1].error and "exit code 7" in done[1].error
    assert all(done[i].error is None and done[i].results[0] is not None for i in (0, 2, 3))  # one worker: restarted
    assert not spawned_children()


CTRL_C = """
import signal, sys, time
from vlmrun import LLM, SamplingParams

if __name__ == "__main__":
    # Ctrl-C as in a terminal: a process started in the background (a test run launched with `&`) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", preprocess_workers=2, preprocess_pool="process")
    prompts = ("Count to %d." % i for i in range(10**6))
    for index, out in llm.generate_stream(prompts, SamplingParams(max_tokens=1), use_tqdm=False):
        print("running", flush=True)
        time.sleep(0.05)
"""


def test_ctrl_c_stops_the_worker_processes(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(CTRL_C)
    proc = subprocess.Popen([sys.executable, str(script), str(qwen3_vl_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("running")
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len([w for w in workers if "resource_tracker" not in " ".join(w.cmdline())]) == 2
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def test_auto_takes_processes_only_past_the_threads_scaling_on_long_calls() -> None:
    assert worker_pool("auto", 2, None, portable=True) == "thread"  # this machine's 2 CPUs
    assert worker_pool("auto", 8, 10_000, portable=True) == "process"
    assert worker_pool("auto", 8, None, portable=True) == "process"  # a generator: unknown length
    assert worker_pool("auto", 8, PROCESS_MIN_INPUTS - 1, portable=True) == "thread"  # too short to pay the start
    assert worker_pool("auto", 8, 10_000, portable=False) == "thread"  # work that cannot go to a process
    assert worker_pool("auto", 8, 10_000, portable=True, main_guarded=False) == "thread"
    assert worker_pool("process", 1, 3, portable=True) == "process"
    assert worker_pool("thread", 8, 10_000, portable=True) == "thread"
    with pytest.raises(ValueError, match="preprocess_pool"):
        worker_pool("fork", 8, None, portable=True)
