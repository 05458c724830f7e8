"""Speculative decoding off and on, on the CPU: decode tokens/s at batch 1 and 16, mean accepted length,
and `vlmrun caption` images/s.

Two engines over the bundled default model (`vlmrun-shapes-qwen3_5`, float32, a hybrid Gated
DeltaNet model with one MTP layer), one plain and one speculating (`--spec`, default
{"method": "mtp", "num_speculative_tokens": 3}; n-gram drafts with e.g. `--spec '{"method": "ngram",
"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'`), in one process,
each measurement run as a back-to-back pair, off then on or on then off by turns (--rounds pairs,
the median reported). Each call captions generated shape scenes with the model's own prompt (`DESCRIBE_PROMPT`), greedy, two workloads: **captions** (up to
--max-tokens, ending at EOS: 8 to 24 tokens) and **continued** (--max-tokens tokens, EOS ignored:
after its caption the model goes on in text it was never trained to write).
**decode tokens/s**: the tokens after each request's first, over the time from the batch's last
first token to its last finished request (`RequestOutput.metrics`; the prefill left out). The
speculating engine's tokens must equal the plain one's (checked), and its mean accepted length
(tokens per verify step: 1 + accepted drafts) and acceptance rate come from
`RequestOutput.metrics.spec_decode`. `--profile` adds where a batch-1 caption step's time goes
(cProfile, ms per engine step in the model, the GDN layers, the MTP catch-up and drafts, ...);
`--step-times` the same parts timed with perf_counter around each, without a profiler.

**caption images/s** (--caption-scenes N, 0 to skip): the caption job as `vlmrun caption FOLDER`
runs it (`run_caption_job`: the folder walk, preprocessing workers, continuous batching, JSONL records
written) over N generated scenes saved as PNG, with and without the same speculative_config,
alternating (--rounds each), timed from the first input to the last record (the engine load not
timed); the captions must be the same. `--caption-spec` gives the job its own speculative_config
(e.g. with vLLM's `disable_by_batch_size`); `--caption-folder DIR` captions DIR instead (assets/images:
the main job of `make demo`). `--batches` with no sizes skips the decode part.

    OMP_NUM_THREADS=1 python -m bench.bench_spec_decode --rounds 5 --caption-scenes 256 --profile
    OMP_NUM_THREADS=1 python -m bench.bench_spec_decode --rounds 7 --batches --caption-folder assets/images

`--device cuda` runs both engines on the GPU (the same bundled model and its trained MTP layer: where
a decode step is launch- or memory-bound, as the issue expects speculation to pay), `--verify-cuda-graphs`
adds the opt-in verify graphs to the speculating engine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from bench.common import describe_run
from testing.scene_drawing import render_scene
from vlmrun import LLM, SamplingParams
from vlmrun.engine.engine import Engine
from vlmrun.engine.scheduler import Scheduler
from vlmrun.executor.model_runner import ModelRunner
from vlmrun.executor.mtp_steps import MTPStep
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend
from vlmrun.layers.sampler import Sampler
from vlmrun.default_model import default_model_path
from vlmrun.layers.cpu_kernels import _cpu_model_name as cpu_model_name
from vlmrun.shape_scenes import DESCRIBE_PROMPT, make_scene
from vlmrun.spec_decode.metrics import SpecDecodeStats

DEFAULT_SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def caption_batch(llm: LLM, images: list, max_tokens: int,
                  ignore_eos: bool) -> tuple[float, list[list[int]], SpecDecodeStats]:
    """Decode tokens/s of one `generate` call over `images`, the token ids, and the summed speculation counters."""
    prompts = [{"prompt": DESCRIBE_PROMPT, "images": [image]} for image in images]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=False)
    decode_start = max(o.metrics.first_token_time for o in outs)
    decode_end = max(o.metrics.finished_time for o in outs)
    stats = SpecDecodeStats()
    for out in outs:
        if out.metrics.spec_decode is not None:
            stats = stats.merged(out.metrics.spec_decode)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return decoded / max(decode_end - decode_start, 1e-9), [o.token_ids for o in outs], stats


WORKLOADS = {"captions": False, "continued": True}  # name -> ignore_eos


def _order(r: int) -> tuple[str, str]:
    return ("off", "on") if r % 2 == 0 else ("on", "off")


def measure(engines: dict[str, LLM], args: argparse.Namespace) -> None:
    scenes = {batch: [render_scene(make_scene(11, batch * 100 + i)) for i in range(batch)] for batch in args.batches}
    for llm in engines.values():  # warm-up: first calls pack weights and fault memory in
        caption_batch(llm, scenes[args.batches[0]][:1], 8, ignore_eos=True)
    rates: dict[tuple[str, str, int], list[float]] = {}
    spec_stats: dict[tuple[str, int], SpecDecodeStats] = {}
    first: dict[tuple[str, str, int], list[list[int]]] = {}  # round 0's tokens per (mode, workload, batch)
    for r in range(args.rounds):
        for workload, ignore_eos in WORKLOADS.items():
            for batch in args.batches:
                for mode in _order(r):  # each pair back to back: a shared machine's load moves by the minute
                    tok_s, tokens, stats = caption_batch(engines[mode], scenes[batch], args.max_tokens, ignore_eos)
                    rates.setdefault((mode, workload, batch), []).append(tok_s)
                    if r == 0:
                        first[(mode, workload, batch)] = tokens
                        if mode == "on":
                            spec_stats[(workload, batch)] = stats
    for workload in WORKLOADS:
        for batch in args.batches:
            assert first[("on", workload, batch)] == first[("off", workload, batch)], "speculation changed a token"
            off, on = (statistics.median(rates[(mode, workload, batch)]) for mode in ("off", "on"))
            stats = spec_stats[(workload, batch)]
            print(f"{workload}, batch {batch}: off {off:.1f} decode tok/s; on {on:.1f} ({on / off:.2f}x); mean "
                  f"accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.0%} "
                  f"({stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts, {stats.num_drafts} "
                  f"verify steps)", flush=True)


# where a decode step's time goes (--profile, --step-times): label -> (class, method), cumulative times
PARTS = {
    "engine step": (Engine, "step"),
    "model forward": (ModelRunner, "forward"),
    "  GDN decode": (TorchGDNBackend, "_decode"),
    "  GDN verify (per position)": (TorchGDNBackend, "_verify"),
    "MTP catch-up": (MTPStep, "catch_up"),
    "MTP drafts": (MTPStep, "draft"),
    "sampling": (Sampler, "sample"),
    "collect (acceptance, GDN states kept)": (ModelRunner, "collect"),
    "scheduler": (Scheduler, "schedule"),
}


def profiled_parts(run: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """`run()` under cProfile: label -> (calls, seconds inside) of each part (the profiler's own cost
    inflates the Python-heavy parts)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    table = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive calls, tottime, cumtime, callers)
    parts = {}
    for label, (owner, name) in PARTS.items():
        code = inspect.unwrap(getattr(owner, name)).__code__
        calls, _, _, cumtime, _ = table.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0, 0, 0.0, {}))
        parts[label] = (calls, cumtime)
    return parts


def timed_parts(run: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """`run()` with each part's method wrapped in a perf_counter pair (no profiler): label -> (calls,
    seconds inside)."""
    totals = {label: [0, 0.0] for label in PARTS}
    originals = {label: owner.__dict__[name] for label, (owner, name) in PARTS.items()}

    def timing(method: Callable, total: list) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                total[0] += 1
                total[1] += time.perf_counter() - start
        return timed

    for label, (owner, name) in PARTS.items():
        setattr(owner, name, timing(originals[label], totals[label]))
    try:
        run()
    finally:
        for label, (owner, name) in PARTS.items():
            setattr(owner, name, originals[label])
    return {label: (calls, seconds) for label, (calls, seconds) in totals.items()}


def step_parts(engines: dict[str, LLM], args: argparse.Namespace, profiled: bool) -> None:
    """Over --rounds batch-1 caption calls per engine: ms per engine step in each part, under cProfile
    (--profile) or timed without it (--step-times)."""
    images = [render_scene(make_scene(11, 100 + i)) for i in range(args.rounds)]
    for mode, llm in engines.items():
        caption_batch(llm, images[:1], 8, ignore_eos=True)
        tokens = 0

        def run() -> None:
            nonlocal tokens
            tokens = sum(len(ids) for image in images for ids in caption_batch(llm, [image], args.max_tokens, False)[1])

        parts = (profiled_parts if profiled else timed_parts)(run)
        steps = parts["engine step"][0]
        cells = "; ".join(f"{label} {1000 * seconds / steps:.2f}" for label, (_, seconds) in parts.items())
        print(f"{'profile' if profiled else 'step times'} {mode}: {steps} engine steps for {tokens} tokens; "
              f"ms per step: {cells}", flush=True)


def engine_options(args: argparse.Namespace) -> dict:
    """The engines' options: float32 on --device (the CPU by default), verify CUDA graphs when asked."""
    options = {"dtype": "float32", "device": args.device}
    return {**options, "verify_cuda_graphs": True} if args.verify_cuda_graphs else options


def caption_job(folder: Path, out: Path, engine: dict, spec: dict | None,
                max_tokens: int) -> tuple[float, dict[str, str], SpecDecodeStats | None]:
    """One `vlmrun caption FOLDER --out OUT` run: images/s, each image's caption, the engine's counters."""
    from vlmrun.jobs.config import CaptionJobConfig
    from vlmrun.jobs.runner import run_caption_job

    options = dict(engine) if spec is None else {**engine, "speculative_config": spec}
    config = CaptionJobConfig(inputs=[str(folder)], model=str(default_model_path()), out=str(out),
                              prompt=DESCRIBE_PROMPT, overwrite=True, progress=False,
                              sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              engine_options=options)
    summary = run_caption_job(config)
    assert summary.failed == 0 and summary.written > 0, summary
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return summary.images_per_s, {r["image"]: r["caption"] for r in records}, summary.spec_decode


def measure_caption_job(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.caption_folder or Path(tmp) / "scenes"
        if args.caption_folder is None:
            folder.mkdir()
            for i in range(args.caption_scenes):
                render_scene(make_scene(12, i)).save(folder / f"scene_{i:04d}.png")
        rates: dict[str, list[float]] = {"off": [], "on": []}
        captions: dict[str, dict[str, str]] = {}
        stats = None
        for r in range(args.rounds):
            for mode in _order(r):
                spec = args.caption_spec or args.spec
                rate, caps, counters = caption_job(folder, Path(tmp) / f"{mode}.jsonl", engine_options(args),
                                                   spec if mode == "on" else None, args.max_tokens)
                rates[mode].append(rate)
                captions.setdefault(mode, caps)
                if mode == "on":
                    stats = counters
        assert captions["on"] == captions["off"], "speculation changed a caption"
    off, on = (statistics.median(rates[mode]) for mode in ("off", "on"))
    print(f"caption job speculative_config: {json.dumps(args.caption_spec or args.spec)}")
    what = str(args.caption_folder) if args.caption_folder else f"{args.caption_scenes} scenes"
    print(f"caption job, {what}: off {off:.2f} images/s; on {on:.2f} ({on / off:.2f}x); "
          f"mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.0%}; "
          f"runs off {[round(x, 2) for x in rates['off']]}, on {[round(x, 2) for x in rates['on']]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16], help="(none: skip the decode part)")
    parser.add_argument("--spec", type=json.loads, default=DEFAULT_SPEC, help="the speculative_config, as JSON")
    parser.add_argument("--caption-scenes", type=int, default=0, help="scenes for the caption-job part (0: skip it)")
    parser.add_argument("--caption-folder", type=Path, default=None,
                        help="the caption-job part captions this folder instead of generated scenes "
                             "(assets/images: the main job's sample images)")
    parser.add_argument("--caption-spec", type=json.loads, default=None,
                        help="the caption job's speculative_config, as JSON (default: --spec), e.g. with "
                             "disable_by_batch_size")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the engines' device)")
    parser.add_argument("--verify-cuda-graphs", action="store_true",
                        help="CUDA: the speculating engine replays verify steps from CUDA graphs (opt-in)")
    parser.add_argument("--profile", action="store_true", help="also: where a batch-1 step's time goes (cProfile)")
    parser.add_argument("--step-times", action="store_true",
                        help="also: where a batch-1 step's time goes, timed without a profiler")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_model_name()
    print(describe_run("bench.bench_spec_decode"), "|", device, flush=True)
    print(f"speculative_config: {json.dumps(args.spec)}", flush=True)
    if args.batches:
        engines = {mode: LLM(None, speculative_config=args.spec if mode == "on" else None, **engine_options(args))
                   for mode in ("off", "on")}
        measure(engines, args)
        if args.profile:
            step_parts(engines, args, profiled=True)
        if args.step_times:
            step_parts(engines, args, profiled=False)
        for llm in engines.values():
            llm.engine.shutdown()
    if args.caption_scenes or args.caption_folder:
        measure_caption_job(args)


if __name__ == "__main__":
    main()
