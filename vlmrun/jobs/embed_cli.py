"""`vlmrun embed`: embed many images into a JSONL or Parquet file, resumably (the caption job's machinery).

    vlmrun embed INPUT... --out FILE [--model M] [--prompt P] [--dimensions N] [--no-normalize]
                 [--pooling-type LAST|MEAN|CLS] [--resume | --overwrite] [--retry-errors]
                 [--ray [--ray-address ADDR]]

Each image (with the `--prompt` text, in one user turn through the chat template) runs as a pooling
request on an engine started with runner="pooling"; its record is the caption record with `caption`
null, `num_tokens` the prompt's tokens and `embedding` the vector (in Parquet a fixed-size list column
of float32). Inputs, resume (exactly once), error records, progress and exit status are `vlmrun
caption`'s (`vlmrun/jobs/cli.py`); docs/guide/embeddings.md.
"""

from __future__ import annotations

import argparse
import sys

from vlmrun.jobs.cli import (EXIT_USAGE, add_engine_args, add_job_args, add_ray_args, engine_options, ray_options,
                             sigterm_as_interrupt)
from vlmrun.jobs.config import DEFAULT_PREFETCH, CaptionJobConfig

DEFAULT_EMBED_PROMPT = ""  # the image alone (its user turn has an empty text part)


def build_config(args: argparse.Namespace) -> CaptionJobConfig:
    """The job settings the parsed command line asks for (ValueError for bad values)."""
    from vlmrun.default_model import resolve_model
    from vlmrun.pooling.params import PoolingParams

    engine = {**engine_options(args), "runner": "pooling"}
    if args.pooling_type is not None:
        engine["pooler_config"] = {"pooling_type": args.pooling_type}
    return CaptionJobConfig(
        inputs=list(args.inputs), model=resolve_model(args.model), out=args.out, prompt=args.prompt,
        engine_options=engine, workers=args.workers, prefetch=args.prefetch, overwrite=args.overwrite,
        retry_errors=args.retry_errors, image_column=args.image_column, fsync_interval=args.fsync_interval,
        progress=not args.no_progress, ray=ray_options(args),
        pooling=PoolingParams(dimensions=args.dimensions, normalize=args.normalize))


def embed(args: argparse.Namespace) -> int:
    from vlmrun.jobs.runner import NoInputsError, run_caption_job
    from vlmrun.jobs.sink import OutputError

    try:
        config = build_config(args)
        with sigterm_as_interrupt():
            summary = run_caption_job(config)
    except (NoInputsError, OutputError, ValueError, OSError, ImportError) as exc:
        print(f"vlmrun embed: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in summary.lines():
        print(line, file=sys.stderr)
    return summary.exit_code()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed images (files, folders, globs, manifests) into JSONL / Parquet",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="image file, directory (recursive), glob, URL, or manifest (.txt/.csv/.jsonl/.parquet)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write one record per image to FILE (*.jsonl or *.parquet; - for JSONL on stdout)")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or hub id (default: the bundled shapes model, assets/model/)")
    p.add_argument("--prompt", default=DEFAULT_EMBED_PROMPT, help="text given with each image (default: none)")
    g = p.add_argument_group("pooling (default: the checkpoint's, read as sentence-transformers reads it)")
    g.add_argument("--dimensions", type=int, default=None,
                   help="Matryoshka: keep this many values, then normalize (the checkpoint must allow it)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalize each vector (default: the checkpoint's, else yes)")
    g.add_argument("--pooling-type", choices=("LAST", "MEAN", "CLS"), default=None,
                   help="override the checkpoint's pooling (default: its own, else LAST)")
    add_engine_args(p.add_argument_group("engine"))
    add_job_args(p.add_argument_group("job"), "embed")
    add_ray_args(p.add_argument_group("Ray (pip install 'vlmrun[ray]')"))
    p.set_defaults(func=embed, overwrite=False, prefetch=DEFAULT_PREFETCH)
