"""The per-call plumbing of `LLM` (vlmrun/api.py): prompts parsed now or lazily, one value per input
from a list or a single value, outputs put back in input order, one warning naming a call's failed inputs."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable, Iterator, Optional, Sequence, TypeVar

from vlmrun.engine.prompt_forms import parse_prompt

logger = logging.getLogger("vlmrun.api")
T = TypeVar("T")


def prompt_inputs(prompts: Any) -> tuple[Iterable[Any], Optional[int]]:
    """The prompts parsed (a list: all now, so a prompt of no form fails before anything runs; any
    other iterable: lazily) and their number (None: unknown)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, Sequence):
        return [parse_prompt(prompt) for prompt in prompts], len(prompts)
    return (parse_prompt(prompt) for prompt in prompts), None


def warn_failed(call: str, failed: list[tuple[int, str]], empty: str = "outputs=[]", shown: int = 3) -> None:
    """One warning naming a call's failed inputs (index and error, the first `shown`) and their count;
    `empty` says what their output holds."""
    if not failed:
        return
    failed = sorted(failed)
    named = "; ".join(f"input {index}: {error}" for index, error in failed[:shown])
    more = f"; and {len(failed) - shown} more" if len(failed) > shown else ""
    logger.warning("LLM.%s: %d input(s) failed; their output has %s and .error set (%s%s). vLLM would raise; "
                   "vlmrun kept the other inputs' outputs.", call, len(failed), empty, named, more)


def in_input_order(stream: Iterator[tuple[int, T]]) -> list[T]:
    by_index = dict(stream)
    return [by_index[i] for i in range(len(by_index))]


def per_input(arg: Any, n: Optional[int], what: str, default: Any) -> Iterator[Any]:
    """One value per input: a list of n (n None: checked as the inputs are read), or one value (None:
    `default`) for all."""
    if isinstance(arg, (list, tuple)):
        if n is not None and len(arg) != n:
            raise ValueError(f"got {len(arg)} {what} for {n} prompts")
        return iter(arg)
    return itertools.repeat(arg or default)
