"""Command line entry point: `vlmrun caption | embed | run-batch | serve | web`, and `vlmrun --version`.

Each subcommand lives with the code it drives and registers its own parser here. Building the parser
imports no torch, transformers or web framework (tests/test_cli_startup.py): `vlmrun --help` answers at
once, and a subcommand imports what it runs only when it runs. Every option's help shows its default.
"""

from __future__ import annotations

import argparse
import sys


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Each option's help ends with its default, where it has a real one (not None, False or empty) and
    the help does not already give it. (argparse's ArgumentDefaultsHelpFormatter skips options without
    help and repeats defaults their help already states.)"""
    for action in parser._actions:
        default = action.default
        text = action.help or ""
        if (not action.option_strings or action.help is argparse.SUPPRESS or default is None or default is False
                or default == [] or default is argparse.SUPPRESS or "%(default)" in text
                or "default" in text.lower()):
            continue
        action.help = f"{text} (default: %(default)s)".lstrip()


def version() -> str:
    """This checkout's vlmrun version (the installed distribution's metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vlmrun")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the clone)"


def build_parser() -> argparse.ArgumentParser:
    from vlmrun.jobs import cli as jobs_cli
    from vlmrun.jobs import embed_cli
    from vlmrun.jobs import run_batch_cli
    from vlmrun.server import cli as server_cli
    from vlmrun.web import cli as web_cli

    parser = argparse.ArgumentParser(
        prog="vlmrun",
        description="vlmrun: a vision-language inference engine (Qwen VL models; images and text in, text out).",
        epilog="With no --model, every command runs the bundled 3M-parameter shapes model, which only knows "
               "coloured shapes; name a real one, e.g. --model Qwen/Qwen3-VL-2B-Instruct. "
               "`vlmrun COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"vlmrun {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    jobs_cli.register(sub)
    embed_cli.register(sub)
    run_batch_cli.register(sub)
    server_cli.register(sub)
    web_cli.register(sub)
    for command in sub.choices.values():
        show_defaults(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
