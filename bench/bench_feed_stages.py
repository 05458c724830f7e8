"""What the input pipeline's workers run, stage by stage: how long each stage takes, how much of it holds
the GIL, and how it scales with worker threads, beside worker processes for the whole per-input work.

The stages of one caption input (the bundled model's processor, --size px PNG shape scenes):

- decode: `load_image` (PIL: PNG decode, RGB);
- image: `ImageProcessor.preprocess` (torchvision resize, rescale / normalise, patchify, content hash);
- text: `Processor.process_prompt` of the text alone (chat template, tokenizer);
- whole: `load_image` + `process_prompt` with the image, as a pipeline worker runs it.

GIL share: a pure-Python probe thread counts while one thread runs the stage; the probe's rate drops
by the share of the time the stage holds the GIL (1.0: it holds it throughout, as pure Python does;
0.0: it releases it throughout). Threads that hold the GIL cannot run at once, so a stage scales with
threads by at most 1 / share; processes scale without that bound but pickle each prompt (its pixels)
back. On a machine with other load the probe also loses time to other processes: read the shares
beside each other, not as exact figures.

Then the pipeline's own prefetch (`vlmrun.feed.prefetch.Prefetcher`, --prefetch ahead) over the same
inputs as `LLM.generate` prompts, with worker threads and with worker processes
(`vlmrun.feed.process_workers`: the processor loaded once per process, prompts back through shared
memory): the preprocessing rate `preprocess_pool="thread"` / `"process"` gives a call.

    python -m bench.bench_feed_stages --images 48 --workers 1,2,4
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable

import torch
from PIL import Image

from bench.common import describe_run
from vlmrun.feed.prefetch import FeedDone, Prefetcher
from vlmrun.feed.prepare import GeneratePrepare
from vlmrun.feed.process_workers import WorkerProcess
from vlmrun.feed.workers import usable_cpus
from vlmrun.processors import Processor, load_image

PROMPT = "Describe the image."
_PROCESSOR: dict[str, Processor] = {}  # the processor of this process (one per worker process)


def _processor() -> Processor:
    if "p" not in _PROCESSOR:
        from vlmrun.default_model import default_model_path

        _PROCESSOR["p"] = Processor.from_pretrained(str(default_model_path()))
    return _PROCESSOR["p"]


def scene_pngs(n: int, size: int) -> list[bytes]:
    """`n` shape scenes as PNG bytes, `size` px square."""
    from testing.scene_drawing import render_scene
    from vlmrun.shape_scenes import make_scene

    out = []
    for i in range(n):
        buf = io.BytesIO()
        render_scene(make_scene(7, i)).resize((size, size), Image.BILINEAR).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def prepare_input(png: bytes) -> Any:
    """What a pipeline worker does for one caption input (in a worker process: its own processor)."""
    torch.set_num_threads(1)
    processor = _processor()
    return processor.process_prompt(PROMPT, [load_image(png, processor.limits)])


def process_rate(pngs: list[bytes], workers: int, repeats: int) -> float:
    """Inputs/s of the whole per-input work over `workers` processes (each prompt pickled back)."""
    best = float("inf")
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(prepare_input, pngs[:2 * workers]))  # warm-up: every worker has its processor
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(prepare_input, pngs))
            best = min(best, time.perf_counter() - start)
    return len(pngs) / best


def prefetch_rate(pngs: list[bytes], workers: int, pool: str, repeats: int, prefetch: int) -> float:
    """Inputs/s of the pipeline's prefetch over `workers` threads or processes, best of `repeats` (after a
    warm-up pass that also starts the processes)."""
    prepare = GeneratePrepare(_processor())
    prompts = [{"prompt": PROMPT, "images": [png]} for png in pngs]
    processes = [WorkerProcess(prepare) for _ in range(workers)] if pool == "process" else []
    prepares = [lambda prompt, p=p: p.run(prompt) for p in processes] if processes else prepare
    best = float("inf")
    try:
        for r in range(repeats + 1):
            start = time.perf_counter()
            prefetcher = Prefetcher(prompts if r else prompts[:2 * workers], prepares, workers, prefetch)
            while not isinstance(prefetcher.take(wait=True), FeedDone):
                pass
            prefetcher.close()
            if r:
                best = min(best, time.perf_counter() - start)
    finally:
        for process in processes:
            process.close()
    return len(pngs) / best


def stages(pngs: list[bytes]) -> dict[str, tuple[Callable[[Any], Any], list[Any]]]:
    """name -> (the stage as a function of one input, its inputs)."""
    processor = _processor()
    images = [load_image(png, processor.limits) for png in pngs]
    return {
        "decode": (lambda png: load_image(png, processor.limits), pngs),
        "image": (processor.image_processor.preprocess, images),
        "text": (lambda _: processor.process_prompt(PROMPT, []), pngs),
        "whole": (lambda png: processor.process_prompt(PROMPT, [load_image(png, processor.limits)]), pngs),
    }


def probe_rate(seconds: float, stop: threading.Event | None = None) -> float:
    """Pure-Python loop iterations per second (holds the GIL whenever it runs)."""
    count, start = 0, time.perf_counter()
    end = start + seconds
    while (stop is None and time.perf_counter() < end) or (stop is not None and not stop.is_set()):
        for _ in range(1000):
            count += 1
    return count / (time.perf_counter() - start)


def seconds_per_input(fn: Callable[[Any], Any], inputs: list[Any], repeats: int) -> float:
    """One thread, nothing beside it: the best of `repeats` passes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in inputs:
            fn(item)
        best = min(best, time.perf_counter() - start)
    return best / len(inputs)


def gil_share(fn: Callable[[Any], Any], inputs: list[Any]) -> float:
    """The share of the stage's time it holds the GIL: how much it slows the probe thread (the switch
    interval shortened to 0.1 ms, so the stage gets the GIL back at once when it needs it)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        alone = probe_rate(0.5)
        stop = threading.Event()

        def run() -> None:
            for item in inputs:
                fn(item)
            stop.set()

        worker = threading.Thread(target=run)
        worker.start()
        during = probe_rate(0.0, stop)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return min(1.0, max(0.0, 1.0 - during / alone))


def thread_rate(fn: Callable[[Any], Any], inputs: list[Any], workers: int, repeats: int) -> float:
    """Inputs/s of the stage over `workers` threads (one torch thread each), best of `repeats`."""
    def one(item: Any) -> Any:
        torch.set_num_threads(1)
        return fn(item)

    best = float("inf")
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, inputs[:2 * workers]))
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(one, inputs))
            best = min(best, time.perf_counter() - start)
    return len(inputs) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--size", type=int, default=448, help="scene side in px")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=64, help="the prefetch's processed prompts ahead")
    parser.add_argument("--pipeline-only", action="store_true", help="only the prefetch's threads vs processes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workers = [int(n) for n in args.workers.split(",")]
    pngs = scene_pngs(args.images, args.size)
    print(f"{describe_run(__spec__.name)}, {usable_cpus()} usable CPUs | {args.images} shape scenes {args.size} px")
    if not args.pipeline_only:
        for name, (fn, inputs) in stages(pngs).items():
            per_input, share = seconds_per_input(fn, inputs, args.repeats), gil_share(fn, inputs)
            rates = ", ".join(f"{n}: {thread_rate(fn, inputs, n, args.repeats):.0f}/s" for n in workers)
            print(f"  {name:<6} {per_input * 1e3:6.2f} ms/input, GIL held {share:4.0%} | threads {rates}", flush=True)
        print("  whole  processes " + ", ".join(f"{n}: {process_rate(pngs, n, args.repeats):.0f}/s" for n in workers))
    for pool in ("thread", "process"):
        rates = ", ".join(f"{n}: {prefetch_rate(pngs, n, pool, args.repeats, args.prefetch):.0f}/s" for n in workers)
        print(f"  prefetch, {pool} workers: {rates}", flush=True)


if __name__ == "__main__":
    main()
