"""Command line entry point: `vlmrun caption | run-batch | serve | web | ...`.

Each subcommand lives with the code it drives and registers its own parser here.
"""

from __future__ import annotations

import argparse
import sys

from vlmrun.jobs import cli as jobs_cli
from vlmrun.jobs import run_batch_cli
from vlmrun.server import cli as server_cli
from vlmrun.web import cli as web_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmrun", description="vlmrun: a vision-language inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    jobs_cli.register(sub)
    run_batch_cli.register(sub)
    server_cli.register(sub)
    web_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
