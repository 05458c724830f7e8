"""Per-request sampling settings: `SamplingParams`.

Names and defaults follow the ones users of OpenAI-style servers and vLLM expect:

- `temperature` below `GREEDY_EPS` (1e-5) means greedy decoding; `top_p`, `top_k` and `min_p`
  are then ignored.
- `top_k` 0 or -1 turns top-k off; `top_p` 1.0 and `min_p` 0.0 are off too.
- `repetition_penalty` (HF/vLLM semantics) looks at prompt + output tokens;
  `presence_penalty` / `frequency_penalty` (OpenAI semantics) look at output tokens only.
- `max_tokens` None means "until the context is full"; the engine caps it by the model length.
- `min_tokens`: EOS and `stop_token_ids` cannot be sampled, and stop strings are not checked,
  until that many tokens were generated.
- `logprobs`: how many top log-probabilities to return per generated token (the chosen token
  is always added, so a dict holds `logprobs` or `logprobs + 1` entries); None returns none.
- `stop`: strings that end generation; the returned text stops before the stop string unless
  `include_stop_str_in_output`.
- `seed`: a seeded request draws from its own generator, so it yields the same tokens whatever
  batch it shares.

`__post_init__` normalises `stop` (a string becomes a one-item list) and `stop_token_ids`
(None becomes an empty list), and raises `ValueError` naming the bad field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

GREEDY_EPS = 1e-5  # temperatures below this are greedy


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    # ------------------------------------------------------------------ normalisation

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.repetition_penalty > 0.0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _require(-2.0 <= self.presence_penalty <= 2.0,
                 f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0,
                 f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _require(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")
        self._validate_lengths()
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
                 f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 f"stop strings must be non-empty strings, got {self.stop!r}")
        _require(all(t >= 0 for t in self.stop_token_ids),
                 f"stop_token_ids must be non-negative, got {self.stop_token_ids!r}")

    def _validate_lengths(self) -> None:
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                 f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    # ------------------------------------------------------------------ derived views

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature below GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (possibly empty)."""
        assert isinstance(self.stop, list)  # normalised by __post_init__
        return self.stop

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def stop_ids_for(self, eos_token_ids: list[int] | tuple[int, ...]) -> list[int]:
        """Token ids that finish the request: EOS (unless ignore_eos) plus stop_token_ids."""
        ids = [] if self.ignore_eos else list(eos_token_ids)
        return ids + [t for t in self.stop_token_ids if t not in ids]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
