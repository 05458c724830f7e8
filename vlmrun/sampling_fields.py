"""The field checks of `SamplingParams` (`vlmrun/sampling_params.py`): each normalises one field's value
or raises `SamplingParamError` (a ValueError) naming the field and what it allows; wrong types are
refused, never coerced. Also vLLM's `RequestOutputKind` and the bounds the checks enforce.
"""

from __future__ import annotations

import math
import numbers
from enum import IntEnum
from typing import Any, Optional

TOKEN_ID_MAX = 2**63 - 1  # stop token ids must fit an int64 tensor
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 1024, 256  # bad_words: how many, how long each


class RequestOutputKind(IntEnum):
    """vLLM's values: what each output of a running request holds."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new (refused: vlmrun hands out whole outputs)
    FINAL_ONLY = 2  # only the finished output


class SamplingParamError(ValueError):
    """A sampling parameter has a bad value; `field` names it (the server's 400 `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------- field checks


def is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer_field(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None,
                  allowed: Optional[str] = None) -> int:
    allowed = allowed or _range_text("an integer", lo, hi)
    if not is_integer(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise SamplingParamError(name, f"{name} must be {allowed}, got {short_repr(value)}")
    return int(value)


def real_field(name: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> float:
    if lo_open:
        allowed = f"a number in ({lo:g}, {hi:g}]" if hi is not None else f"a finite number > {lo:g}"
    else:
        allowed = _range_text("a number", lo, hi)
    number = _as_float(value)
    ok = number is not None and math.isfinite(number) and (number > lo if lo_open else number >= lo) \
        and (hi is None or number <= hi)
    if not ok:
        raise SamplingParamError(name, f"{name} must be {allowed}, got {short_repr(value)}")
    return number


def _as_float(value: Any) -> Optional[float]:
    """`value` as a float (an int too large for one: inf); None for what is not a real number."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def boolean_field(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamError(name, f"{name} must be True or False, got {short_repr(value)}")
    return value


def optional_field(check: Any, name: str, value: Any, **bounds: Any) -> Any:
    return None if value is None else check(name, value, **bounds)


def _range_text(kind: str, lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in [{lo:g}, {hi:g}]" if isinstance(lo, float) else f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"a finite {kind[2:]} >= {lo:g}" if isinstance(lo, float) else f"{kind} >= {lo}"
    return kind


def stop_strings_field(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    allowed = "a non-empty string or a list of non-empty strings"
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingParamError("stop", f"stop must be {allowed}, got {short_repr(stop)}")
    return list(stop)


def _is_token_id(value: Any) -> bool:
    return is_integer(value) and 0 <= value <= TOKEN_ID_MAX


def token_ids_field(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    allowed = f"a list of token ids (integers in [0, {TOKEN_ID_MAX}])"
    if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t) for t in ids):
        raise SamplingParamError(name, f"{name} must be {allowed}, got {short_repr(ids)}")
    return [int(t) for t in ids]


def allowed_token_ids_field(ids: Any) -> Optional[list[int]]:
    if ids is None:
        return None
    ids = token_ids_field("allowed_token_ids", ids)
    if not ids:
        raise SamplingParamError("allowed_token_ids", "allowed_token_ids must not be empty (None allows every token)")
    return ids


def logit_bias_field(bias: Any) -> Optional[dict[int, float]]:
    if bias is None:
        return None
    allowed = f"a dict of token ids (integers in [0, {TOKEN_ID_MAX}]) to finite numbers"
    values = {} if not isinstance(bias, dict) else {t: _as_float(v) for t, v in bias.items()}
    ok = isinstance(bias, dict) and all(_is_token_id(t) and v is not None and math.isfinite(v) for t, v in values.items())
    if not ok:
        raise SamplingParamError("logit_bias", f"logit_bias must be {allowed}, got {short_repr(bias)}")
    return {int(t): v for t, v in values.items()}


def output_kind_field(kind: Any) -> RequestOutputKind:
    try:
        kind = RequestOutputKind(kind)
    except ValueError:
        raise SamplingParamError("output_kind", f"output_kind must be a RequestOutputKind, got {kind!r}") from None
    if kind is RequestOutputKind.DELTA:
        raise SamplingParamError("output_kind", "output_kind DELTA is not supported: LLM returns finished outputs "
                                                "and the server streams its own deltas (use CUMULATIVE or FINAL_ONLY)")
    return kind


def bad_words_field(words: Any) -> Optional[list[str]]:
    if words is None:
        return None
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
        raise SamplingParamError("bad_words", f"bad_words must be a list of words (strings with a non-space "
                                              f"character), got {short_repr(words)}")
    longest = max(map(len, words), default=0)
    if len(words) > MAX_BAD_WORDS or longest > MAX_BAD_WORD_CHARS:
        raise SamplingParamError("bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words of at most "
                                              f"{MAX_BAD_WORD_CHARS} characters each; got {len(words):,} words, "
                                              f"the longest of {longest:,} characters")
    return list(words)


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
