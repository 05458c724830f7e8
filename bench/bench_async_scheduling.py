"""Async scheduling off and on, on the CPU: the host's gap between forwards, decode tokens/s, captions/s.

Two engines over the bundled default model (`vlmrun-shapes-qwen3_5`, float32; `--model bench`: the
CPU bench's random-weight Qwen3-VL, text hidden 512, `bench.common.build_checkpoint`), `async_scheduling`
False and True, in one process, run alternately (--rounds times each, the median reported):

- **gap**: from the end of one step's model forward to the start of the next step's (the LM head and
  sampling, reading the sampled tokens, detokenizing, stop checks, scheduling, building the next
  batch), as a median over the decode steps and as a share of the median step (forward start to
  forward start); and **runner idle**: from the end of one `ModelRunner.launch` to the start of the
  next, the time the runner waits for the engine's thread. Timestamps around `ModelRunner.forward`
  and `ModelRunner.launch`.
- **decode tokens/s** at batch 1 and 64: short text prompts, --max-tokens tokens each (EOS ignored),
  greedy; output tokens over the wall time of the `LLM.generate` call. And at batch 16 with a
  repetition penalty: rows that read their output history, which under async scheduling wait for
  their last token (`Scheduler.must_wait`): the cost of waiting.
- **captions/s**: the caption pipeline (`vlmrun.jobs.pipeline`, as `vlmrun caption` runs it) over
  --scenes generated shape scenes, the model's own caption prompt, greedy.

`--speculative-config JSON` gives both engines speculative decoding (e.g. '{"method": "ngram",
"num_speculative_tokens": 3}'): the cost of async scheduling with it, where a request waits for its
launched verify step; the drafts accepted by each engine are printed.

    python -m bench.bench_async_scheduling --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.common import build_checkpoint, describe_run
from testing.scene_drawing import render_scene
from vlmrun import LLM, SamplingParams
from vlmrun.jobs.inputs import JobItem
from vlmrun.jobs.pipeline import CaptionPipeline, PipelineOptions
from vlmrun.shape_scenes import DESCRIBE_PROMPT, make_scene

PROMPTS = ["Describe the picture.", "What shape is on the left?", "Count the shapes.", "Name the colours."]


class Clock:
    """Start and end times of every call of one method of a runner (patched on the instance)."""

    def __init__(self, runner, method: str) -> None:
        self.spans: list[tuple[float, float]] = []
        self._call: Callable = getattr(runner, method)
        setattr(runner, method, self.call)

    def call(self, *args):
        start = time.perf_counter()
        out = self._call(*args)
        self.spans.append((start, time.perf_counter()))
        return out

    def gap_and_step(self, skip: int) -> tuple[float, float]:
        """Medians of (next start - end) and (next start - start) over consecutive calls, the first
        `skip` calls left out (the prompt's steps)."""
        pairs = list(zip(self.spans[skip:], self.spans[skip + 1:]))
        return (statistics.median(b[0] - a[1] for a, b in pairs), statistics.median(b[0] - a[0] for a, b in pairs))


def model_runner(llm: LLM):
    runner = llm.engine.executor
    return getattr(runner, "runner", runner)  # OverlappedExecutor wraps the ModelRunner


def decode(llm: LLM, batch: int, max_tokens: int, penalized: bool = False) -> dict[str, float]:
    """tokens/s, the forward-to-forward gap and the runner's idle time between steps (the end of one
    `launch` to the start of the next) for `batch` requests decoding `max_tokens` tokens each.
    `penalized`: with a repetition penalty, a row that waits for its token under async scheduling."""
    runner = model_runner(llm)
    forwards, launches = Clock(runner, "forward"), Clock(runner, "launch")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            repetition_penalty=1.1 if penalized else 1.0)
    prompts = [{"prompt": PROMPTS[i % len(PROMPTS)], "images": []} for i in range(batch)]  # templated user turns
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    gap, step = forwards.gap_and_step(skip=2)
    idle, _ = launches.gap_and_step(skip=2)
    del runner.forward, runner.launch  # the class's methods again
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "gap_ms": gap * 1e3, "step_ms": step * 1e3,
            "idle_ms": idle * 1e3}


def caption(llm: LLM, images: list) -> float:
    """Captions/s of the caption pipeline over `images` (PIL images, given as job items)."""
    items = [JobItem(key=f"scene-{i}", source=image) for i, image in enumerate(images)]
    options = PipelineOptions(DESCRIBE_PROMPT, SamplingParams(temperature=0.0, max_tokens=48), "bench")
    done = []
    start = time.perf_counter()
    CaptionPipeline(llm.engine, options).run(iter(items), lambda item, record: done.append(record.error))
    seconds = time.perf_counter() - start
    assert len(done) == len(images) and not any(done), done[:3]
    return len(images) / seconds


def measure(engines: dict[bool, LLM], args: argparse.Namespace) -> None:
    images = [render_scene(make_scene(7, i)) for i in range(args.scenes)]
    results: dict[tuple[bool, str], list[dict[str, float]]] = {}
    for mode in engines:  # warm-up: first calls pack weights and fault memory in
        decode(engines[mode], 4, 8)
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            for batch in args.batches:
                results.setdefault((mode, f"batch {batch}"), []).append(decode(engines[mode], batch, args.max_tokens))
            results.setdefault((mode, "batch 16, rows that wait (repetition penalty)"), []).append(
                decode(engines[mode], 16, args.max_tokens, penalized=True))
            results.setdefault((mode, "caption"), []).append({"img_s": caption(engines[mode], images)})
    print(describe_run("bench.bench_async_scheduling"))
    for key in sorted({k for _, k in results}, key=lambda k: (k == "caption", k)):
        cells = []
        for mode in (False, True):
            runs = results[(mode, key)]
            med = {m: statistics.median(run[m] for run in runs) for m in runs[0]}
            if "img_s" in med:
                cells.append(f"{'on' if mode else 'off'} {med['img_s']:.2f} captions/s")
            else:
                cells.append(f"{'on' if mode else 'off'} {med['tok_s']:.1f} tok/s, gap {med['gap_ms']:.2f} ms of "
                             f"{med['step_ms']:.2f} ms ({med['gap_ms'] / med['step_ms']:.0%}), runner idle "
                             f"{med['idle_ms']:.2f} ms")
        print(f"{key}: " + "; ".join(cells), flush=True)
    for mode, llm in engines.items():
        spec = llm.engine.stats().spec_decode
        if spec is not None:
            print(f"async {'on' if mode else 'off'}: {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts accepted "
                  f"over {spec.num_drafts} verify steps", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--scenes", type=int, default=256)
    parser.add_argument("--model", choices=["default", "bench"], default="default")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON: both engines speculate with it (vLLM's keys)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.model == "default" else str(build_checkpoint(Path(tmp)))
        engines = {mode: LLM(model, dtype="float32", device="cpu", async_scheduling=mode,
                             speculative_config=args.speculative_config) for mode in (False, True)}
        measure(engines, args)
        for llm in engines.values():
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
