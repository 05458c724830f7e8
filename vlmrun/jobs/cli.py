"""`vlmrun caption`: caption many images into a JSONL or Parquet file, resumably (or print them).

    vlmrun caption INPUT... --out FILE [--model M] [--prompt P] [--max-tokens N] [sampling flags]
                   [--json-schema FILE | --regex RE | --choice STR...]
                   [--resume | --overwrite] [--retry-errors] [--ray [--ray-address ADDR]]

--json-schema / --regex / --choice constrain every caption (grammar-constrained decoding); each
record then carries `parsed`, and one whose output does not complete (cut by --max-tokens) is an
error record.

INPUT: image files, directories (recursive), glob patterns, manifests (.txt / .csv / .jsonl /
.parquet of paths or URLs), URLs (see `vlmrun.jobs.inputs`). `--out -` prints JSONL records; without
--out each image prints one line on a terminal, one JSONL record on a pipe. Exit status, of this run:
0 every image it captioned has a caption, 1 some failed (error records) or the output could not be
written (disk full: the summary says how far it got), 2 bad usage or the job could not start (an --out
that is not a caption journal, or that is an input, is refused untouched), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from typing import Any, Iterator, Optional

from vlmrun.cli_options import add_kernel_args, kernel_options
from vlmrun.jobs.config import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFETCH,
    DEFAULT_PROMPT,
    CaptionJobConfig,
    RayOptions,
    default_workers,
)

EXIT_USAGE = 2


def build_config(args: argparse.Namespace) -> CaptionJobConfig:
    """The job settings the parsed command line asks for (ValueError for bad values)."""
    from vlmrun.default_model import resolve_model
    from vlmrun.sampling_params import SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
        structured_outputs=structured_outputs(args),
    )
    engine = engine_options(args)
    if args.lora is not None and args.ray:
        raise ValueError("--lora is not supported with --ray yet")
    if args.lora is not None:  # one adapter, slots sized to it
        from vlmrun.lora.peft_files import configured_rank

        engine.update(enable_lora=True, max_lora_rank=configured_rank(args.lora))
    ray = ray_options(args)
    return CaptionJobConfig(
        inputs=list(args.inputs), model=resolve_model(args.model), out=args.out, prompt=args.prompt,
        sampling=sampling, engine_options=engine, workers=args.workers, prefetch=args.prefetch,
        overwrite=args.overwrite, retry_errors=args.retry_errors, image_column=args.image_column,
        fsync_interval=args.fsync_interval, progress=not args.no_progress, ray=ray, lora=args.lora,
    )


def ray_options(args: argparse.Namespace) -> Optional[RayOptions]:
    """The Ray flags (`add_ray_args`; --ray-address implies --ray), or None without --ray."""
    if not (args.ray or args.ray_address is not None):
        return None
    return RayOptions(address=args.ray_address, actors=args.ray_actors, gpus_per_actor=args.ray_gpus_per_actor,
                      cpus_per_actor=args.ray_cpus_per_actor, batch_size=args.ray_batch_size)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keywords of the engine flags (`add_engine_args`) that were given."""
    engine: dict[str, Any] = {"dtype": args.dtype, "device": args.device, **kernel_options(args)}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes",
                 "encoder_cache_tokens", "max_image_pixels", "tensor_parallel_size", "distributed_executor_backend"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    return engine


def structured_outputs(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The constraint of --json-schema FILE / --regex / --choice, or None (ValueError: unreadable schema)."""
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as fh:
                return {"json": json.load(fh)}
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the JSON schema {args.json_schema!r}: {exc}") from None
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": list(args.choice)}
    return None


def caption(args: argparse.Namespace) -> int:
    from vlmrun.jobs.runner import NoInputsError, run_caption_job
    from vlmrun.jobs.sink import OutputError

    if args.ray_address is not None and not args.ray:
        args.ray = True
    try:
        config = build_config(args)
        with sigterm_as_interrupt():
            summary = run_caption_job(config)
    except (NoInputsError, OutputError, ValueError, OSError, ImportError) as exc:
        print(f"vlmrun caption: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in summary.lines():
        print(line, file=sys.stderr)
    return summary.exit_code()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the job as Ctrl-C does: records flushed, a Parquet output finalised."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def register(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("caption", help="caption images (files, folders, globs, manifests) into JSONL / Parquet",
                         description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    cap.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="image file, directory (recursive), glob, URL, or manifest (.txt/.csv/.jsonl/.parquet)")
    cap.add_argument("--out", default=None, metavar="FILE",
                     help="write one record per image to FILE (*.jsonl or *.parquet; - for JSONL on stdout); "
                          "without it, JSONL records on a pipe, readable lines on a terminal")
    cap.add_argument("--model", default=None,
                     help="HF checkpoint directory or hub id (default: the bundled shapes model, assets/model/)")
    cap.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"instruction given with each image ({DEFAULT_PROMPT!r})")
    cap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="caption length cap in tokens")

    s = cap.add_argument_group("sampling (greedy by default)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None,
                   help="job seed; each image samples with a seed made from it and the image, so reruns repeat")
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens (benchmarks)")

    c = cap.add_argument_group("structured output (each record gets 'parsed')").add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="FILE", help="captions are JSON valid under this schema")
    c.add_argument("--regex", default=None, metavar="RE", help="captions match this regular expression")
    c.add_argument("--choice", action="append", default=[], metavar="STR",
                   help="captions are one of these strings (repeatable)")

    e = cap.add_argument_group("engine")
    e.add_argument("--lora", default=None, metavar="PATH", help="caption with this LoRA adapter (a PEFT folder)")
    add_engine_args(e)
    add_job_args(cap.add_argument_group("job"), "caption")

    add_ray_args(cap.add_argument_group("Ray (pip install 'vlmrun[ray]')"))
    cap.set_defaults(func=caption, overwrite=False)


def add_engine_args(e: argparse._ArgumentGroup) -> None:
    """The engine flags of a job (`caption`, `embed`)."""
    e.add_argument("--dtype", default="auto")
    e.add_argument("--device", default="auto")
    e.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together (engine default 256)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--encoder-cache-tokens", type=int, default=None,
                   help="vision embeddings kept by image content (engine default 32768 tokens)")
    e.add_argument("--max-image-pixels", type=int, default=None, help="images with more pixels are refused")
    add_kernel_args(e)
    e.add_argument("--tensor-parallel-size", type=int, default=None, help="ranks (devices) the model is split over")
    e.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                   help="how the ranks are started: local processes (mp, default) or a Ray placement group")


def add_job_args(j: argparse._ArgumentGroup, verb: str) -> None:
    """The job flags (output mode, workers, manifest column, fsync, progress) of a job (`caption`, `embed`)."""
    mode = j.add_mutually_exclusive_group()
    mode.add_argument("--resume", dest="overwrite", action="store_false",
                      help="skip images already recorded in --out (the default when it exists)")
    mode.add_argument("--overwrite", dest="overwrite", action="store_true", help="start --out afresh")
    j.add_argument("--retry-errors", action="store_true", help=f"on resume, {verb} again the images that failed")
    j.add_argument("--workers", type=int, default=default_workers(),
                   help="threads reading and preprocessing images (default: the CPUs this process may use, at most 8)")
    j.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH,
                   help="preprocessed images kept ready for the engine (bounds memory)")
    j.add_argument("--image-column", default=None, help="manifest column / field holding the images")
    j.add_argument("--fsync-interval", type=float, default=1.0,
                   help="seconds between fsyncs of the output (0: after every record)")
    j.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_ray_args(r: argparse._ArgumentGroup) -> None:
    """The Ray Data flags of a job (`caption`, `embed`)."""
    r.add_argument("--ray", action="store_true", help="run on Ray Data: one engine per actor")
    r.add_argument("--ray-address", default=None,
                   help="cluster to join ('auto', ray://host:10001); implies --ray; default: a local Ray")
    r.add_argument("--ray-actors", type=int, default=None, help="engines (default: one per GPU group, or 1)")
    r.add_argument("--ray-gpus-per-actor", type=float, default=None, help="default: 1 if the cluster has GPUs, else 0")
    r.add_argument("--ray-cpus-per-actor", type=float, default=1.0)
    r.add_argument("--ray-batch-size", type=int, default=64, help="images per actor call")
