"""`SpeculativeConfig`: speculative decoding's settings, with vLLM's names.

`EngineConfig.speculative_config` takes the dict a user gives (`LLM(speculative_config=...)`,
`--speculative-config JSON`) or this dataclass; `SpeculativeConfig.of` checks it. Both methods take
`num_speculative_tokens` (k, required). Method "ngram" (prompt lookup: drafts copied from the
request's own prompt and output, `vlmrun/spec_decode/ngram.py`) also takes the n-gram sizes
`prompt_lookup_min` / `prompt_lookup_max` (vLLM's defaults: both 5 when neither is given, the given one
when one is). Method "mtp" drafts with the checkpoint's multi-token-prediction layer
(`vlmrun/executor/mtp_drafter.py`; Qwen3.5 and Qwen3-Next checkpoints that carry one); vLLM's
per-family names for it, "qwen3_next_mtp" (what the Qwen model cards' vLLM commands pass, for Qwen3-Next
and Qwen3.5 alike) and "qwen3_5_mtp", are read as "mtp", as vLLM reads them. Both take
`disable_by_batch_size` (vLLM's key): a request added while more than that many requests are enqueued
(running + waiting) never speculates.

`num_speculative_tokens` is at most `MAX_SPECULATIVE_TOKENS` (32): a verify step feeds 1 + k positions
per request and the per-position acceptance counters (`/metrics`' `..._per_pos` series, one per draft
position) have k entries, so k sizes memory and work; drafts that far ahead are almost never accepted
(each must follow every earlier one), and a larger value is refused with a ValueError naming the bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

SPECULATIVE_METHODS = ("ngram", "mtp")
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp")  # vLLM's older per-family names of method "mtp"
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
MAX_SPECULATIVE_TOKENS = 32  # the largest num_speculative_tokens (k) taken


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts verified per step and request
    prompt_lookup_min: Optional[int] = None  # ngram: the shortest suffix n-gram looked up
    prompt_lookup_max: Optional[int] = None  # ngram: the longest, tried first
    # a request added while more than this many are enqueued (running + waiting) never speculates; None: all do
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method in MTP_ALIASES:
            object.__setattr__(self, "method", "mtp")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS + MTP_ALIASES)}, got {self.method!r}")
        _check_count("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _check_count("disable_by_batch_size", self.disable_by_batch_size)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if low is not None or high is not None:
                raise ValueError(f"speculative_config: prompt_lookup_min / prompt_lookup_max are method ngram's, "
                                 f"not {self.method}'s")
            return
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _check_count(name, value)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: Union[None, dict[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, or its fields as a dict (ValueError naming an unknown or missing key)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 3}}, got {value!r}')
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                             f"(this engine takes {', '.join(sorted(names))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config: {required!r} is required")
        return cls(**value)


def _check_count(name: str, value: Any, most: Optional[int] = None) -> None:
    """ValueError unless `value` is an integer >= 1 (a bool is not one), and <= `most` when given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"speculative_config: {name} must be at most {most}, got {value}")
