"""The input pipeline (`vlmrun.feed`) measured: memory, time to the first step, images/s of `LLM.generate`
beside the caption job on the same images.

For each N of --images, N shape scenes (`vlmrun.shape_scenes`, --size px square PNG files) are captioned
by the bundled model (`vlmrun.LLM()`, --max-tokens tokens each, EOS ignored), each side in a fresh
process (`bench.common.run_child`):

- generate: `LLM.generate` over a generator of {"prompt", "images": [path]} prompts, after a one-image
  warm-up: peak RSS above the loaded, warmed engine (sampled every 5 ms), seconds from the call to the
  engine's first step, images/s over the call;
- caption: `run_caption_job` (what `vlmrun caption` runs) over the folder: images/s of its summary.

    python -m bench.bench_input_pipeline --images 100,1000 --max-tokens 2 --size 448

The peak holds the prefetch (--prefetch processed prompts) and the inputs whose prefill has not ended
(the engine drops a request's pixels once its images are encoded, and the pipeline admits inputs with
media up to two steps' prefill), not --max-num-seqs requests' pixels, so it is flat in N past those:

    python -m bench.bench_input_pipeline --images 100,1000,10000 --sides generate

(The engine's encoder cache, 32,768 tokens of vision embeddings by default, also fills as N grows, up to
its own bound; --encoder-cache-tokens small leaves the pipeline's own memory, e.g. with
--max-num-seqs 32 --prefetch 16 --encoder-cache-tokens 256.)
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
from PIL import Image

from bench.common import add_threads_option, apply_threads, describe_run, run_child

PROMPT = "Describe the image."


def write_scenes(folder: Path, n: int, size: int) -> list[Path]:
    from testing.scene_drawing import render_scene
    from vlmrun.shape_scenes import make_scene

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        image = render_scene(make_scene(11, i))
        if size:
            image = image.resize((size, size), Image.BILINEAR)
        path = folder / f"scene_{i:06d}.png"
        image.save(path, "PNG")
        paths.append(path)
    return paths


class PeakRSS:
    """The highest RSS of this process while running, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.005):
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def trim_with_slack(slack_mb: int) -> list:
    """Make this process's input pipelines trim the heap with `slack_mb` (0: never, as before the trimmer);
    the trimmers made, to read their `trims` after a run (an A/B switch for this bench only)."""
    import vlmrun.feed.pipeline as feed_pipeline
    from vlmrun.executor.cpu_malloc import HeapTrimmer

    made: list = []

    def trimmer() -> HeapTrimmer:
        made.append(HeapTrimmer(slack_mb << 20) if slack_mb else HeapTrimmer(libc=None))
        return made[-1]

    feed_pipeline.HeapTrimmer = trimmer  # type: ignore[assignment, misc]
    return made


def child_generate(folder: Path, max_tokens: int, max_num_seqs: int, prefetch: int, encoder_cache_tokens: int,
                   max_num_batched_tokens: int, trim_slack_mb: int) -> dict:
    from vlmrun import LLM, SamplingParams

    trimmers = trim_with_slack(trim_slack_mb)

    paths = sorted(folder.glob("*.png"))
    llm = LLM(device="cpu", max_num_seqs=max_num_seqs, preprocess_prefetch=prefetch,
              encoder_cache_tokens=encoder_cache_tokens, max_num_batched_tokens=max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt": PROMPT, "images": [str(paths[0])]}], params, use_tqdm=False)  # warm-up
    gc.collect()
    base = psutil.Process().memory_info().rss
    first_step: list[float] = []
    step = llm.engine.step

    def timed_step() -> Any:
        if not first_step:
            first_step.append(time.perf_counter())
        return step()

    llm.engine.step = timed_step

    def prompts() -> Iterator[dict]:
        for path in paths:
            yield {"prompt": PROMPT, "images": [str(path)]}

    with PeakRSS() as rss:
        start = time.perf_counter()
        outs = llm.generate(prompts(), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert len(outs) == len(paths) and all(o.error is None for o in outs)
    return {"images": len(paths), "peak_above_engine_mb": (rss.peak - base) / 2**20,
            "first_step_s": first_step[0] - start, "elapsed_s": elapsed, "images_per_s": len(paths) / elapsed,
            "workers": llm.preprocess_workers, "prefetch": llm.preprocess_prefetch,
            "trims": trimmers[-1].trims}


def child_caption(folder: Path, max_tokens: int, max_num_seqs: int, prefetch: int, encoder_cache_tokens: int,
                  max_num_batched_tokens: int, trim_slack_mb: int) -> dict:
    from vlmrun.default_model import resolve_model
    from vlmrun.jobs.config import CaptionJobConfig
    from vlmrun.jobs.runner import run_caption_job
    from vlmrun.sampling_params import SamplingParams

    trim_with_slack(trim_slack_mb)
    with tempfile.TemporaryDirectory() as tmp:
        config = CaptionJobConfig(inputs=[str(folder)], model=resolve_model(None), out=str(Path(tmp) / "out.jsonl"),
                                  prompt=PROMPT, progress=False, prefetch=prefetch,
                                  engine_options={"device": "cpu", "max_num_seqs": max_num_seqs,
                                                  "encoder_cache_tokens": encoder_cache_tokens,
                                                  "max_num_batched_tokens": max_num_batched_tokens},
                                  sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        summary = run_caption_job(config)
    assert summary.failed == 0
    return {"images": summary.written, "elapsed_s": summary.elapsed_s, "images_per_s": summary.images_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="100,1000", help="comma-separated image counts")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--size", type=int, default=448, help="scene side in px (0: their own, 64-256)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=64, help="processed prompts ahead of the engine")
    parser.add_argument("--encoder-cache-tokens", type=int, default=32768,
                        help="the engine's encoder cache (it fills with N up to this bound; small: the pipeline alone)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="the engine's step budget (the pipeline keeps two steps' prefill in it)")
    parser.add_argument("--trim-slack-mb", type=int, default=32,
                        help="the pipeline's heap trimmer (vlmrun/executor/cpu_malloc.py HeapTrimmer): RSS growth "
                             "that trims; 0: no trimming (before it)")
    parser.add_argument("--sides", default="generate,caption", help="which to run: generate, caption or both")
    parser.add_argument("--child", choices=("generate", "caption"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    if args.child is not None:
        run = child_generate if args.child == "generate" else child_caption
        print(json.dumps(run(Path(args.folder), args.max_tokens, args.max_num_seqs, args.prefetch,
                             args.encoder_cache_tokens, args.max_num_batched_tokens, args.trim_slack_mb)))
        return
    print(describe_run(__spec__.name))
    common = ["--max-tokens", str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs), "--prefetch",
              str(args.prefetch), "--encoder-cache-tokens", str(args.encoder_cache_tokens),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--trim-slack-mb", str(args.trim_slack_mb), *(["--threads", str(args.threads)] if args.threads else [])]
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.images.split(",")):
            folder = Path(tmp) / f"n{n}"
            write_scenes(folder, n, args.size)
            line = (f"{n:>6,} images {args.size} px, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
                    f"{args.max_num_batched_tokens}:")
            if "generate" in sides:
                gen = run_child(__spec__.name, ["--child", "generate", "--folder", str(folder), *common])
                line += (f" generate peak RSS +{gen['peak_above_engine_mb']:.0f} MB above the engine, first step after "
                         f"{gen['first_step_s']:.3f}s, {gen['images_per_s']:.1f} img/s ({gen['workers']} workers, "
                         f"prefetch {gen['prefetch']}, {gen['trims']} heap trims)")
            if "caption" in sides:
                cap = run_child(__spec__.name, ["--child", "caption", "--folder", str(folder), *common])
                line += f" | caption job {cap['images_per_s']:.1f} img/s"
            print(line, flush=True)


if __name__ == "__main__":
    main()
