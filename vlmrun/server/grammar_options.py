"""`vlmrun serve`'s flags for clients' output constraints (structured outputs), and their settings.

The bounds `GrammarLimits` checks (a constraint's text, a `choice`'s strings), the `GrammarPool`'s
threads, queue and wait (`grammar_pool.py`), and the bytes of compiled grammars the engine's
`GrammarCompiler` keeps. vLLM has no flags for these; the cache size defaults, as in vLLM, to the
`VLLM_XGRAMMAR_CACHE_MB` environment variable when it is set. docs/server_limits.md has them all.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vlmrun.server.settings import MiB

DEFAULT_CACHE_MB = 256
CACHE_MB_VARIABLE = "VLLM_XGRAMMAR_CACHE_MB"


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """The bounds on clients' output constraints (structured outputs; docs/server_limits.md)."""
    p.add_argument("--max-grammar-chars", type=int, default=64 * 1024,
                   help="longest output constraint (JSON schema, regex, grammar, choices as JSON) a request may send")
    p.add_argument("--max-grammar-choices", type=int, default=1024, help="most strings one 'choice' constraint may give")
    p.add_argument("--grammar-workers", type=int, default=2,
                   help="threads compiling output constraints (their own: parsing and tokenizing never wait for them)")
    p.add_argument("--max-pending-grammars", type=int, default=8,
                   help="constraint compiles queued or running at once; one more is a 429")
    p.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                   help="seconds a request waits for its constraint to compile (then a 400; the compile goes on)")
    p.add_argument("--grammar-cache-mb", type=int, default=_env_int(CACHE_MB_VARIABLE, DEFAULT_CACHE_MB),
                   help="MiB of compiled constraints kept for reuse (default: $VLLM_XGRAMMAR_CACHE_MB, as vLLM, or 256)")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def grammar_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields of `add_grammar_args`' flags."""
    return dict(max_grammar_chars=args.max_grammar_chars, max_grammar_choices=args.max_grammar_choices,
                grammar_workers=args.grammar_workers, max_pending_grammars=args.max_pending_grammars,
                grammar_timeout_s=args.grammar_compile_timeout, grammar_cache_bytes=args.grammar_cache_mb * MiB)

