"""Per-request sampling settings: `SamplingParams`.

Names and defaults follow the ones users of OpenAI-style servers and vLLM expect:

- `temperature` below `GREEDY_EPS` (1e-5): greedy (`top_p`, `top_k`, `min_p` then ignored); `top_k`
  0 or -1 turns top-k off; `top_p` 1.0 and `min_p` 0.0 are off too.
- `repetition_penalty` (HF/vLLM semantics) looks at prompt + output tokens;
  `presence_penalty` / `frequency_penalty` (OpenAI semantics) look at output tokens only.
- `max_tokens` None: until the context is full. `min_tokens`: EOS and `stop_token_ids` cannot be sampled, and stop
  strings are not checked, until that many tokens were generated.
- `logprobs`: how many top log-probabilities to return per generated token (at most
  `MAX_LOGPROBS`; the chosen token is always added, so a dict holds `logprobs` or `logprobs + 1`
  entries); None returns none.
- `stop`: strings that end generation (the text stops before one unless `include_stop_str_in_output`).
- `structured_outputs`: a `vlmrun.structured.StructuredOutputsParams` (or a dict of its fields):
  the output must match a JSON schema, any JSON object, a regex, one of some strings or an EBNF
  grammar. The shape is checked here; the engine compiles it before queueing the request. A
  constrained request ends when its grammar does (EOS is allowed only where the grammar may end);
  `min_tokens` does not hold that end back. With `structured_outputs.after_reasoning` the model
  reasons freely in `<think>…</think>` first and the constraint holds after `</think>`.
- `thinking_token_budget` (vLLM's name): at most this many tokens of reasoning (inside
  `<think>…</think>`, counted from the think's start); then `</think>` is forced. None: no limit.
  A request with a budget has its constraint (if any) hold after the reasoning, as `after_reasoning`.
  The think must start in the prompt, or be opened by the model with a single `<think>` token.
- `logit_bias` (vLLM's, a dict of token id to a finite number): added to that token's logit
  before the penalties. `allowed_token_ids` (a non-empty list): every other token gets `-inf`.
  `bad_words` (a list of words): the engine tokenizes each word once, alone and after a space (the
  spaced form kept when it starts with another token and has as many tokens, as vLLM does:
  `tokenize_bad_words`; the server tokenizes them before submitting, so the engine's call is free),
  and the sampler bans a word's last token whenever its other tokens are the latest output tokens.
  At most `MAX_BAD_WORDS` words of `MAX_BAD_WORD_CHARS` characters each (each costs every step).
  Token ids past the vocabulary are refused by `check_token_ids`, which the engine calls.
- `prompt_logprobs` (vLLM's): for every prompt token after the first, its logprob and the top
  `prompt_logprobs` (at most `MAX_LOGPROBS`) at its position; the first position is None. Such a
  request takes no prefix-cache hit (its prompt's logits must be computed), as in vLLM.
- `truncate_prompt_tokens` (vLLM's): keep only the last k prompt tokens; -1 keeps the last
  `max_model_len` (the engine applies it, and refuses a cut through an image).
- `output_kind` (vLLM's `RequestOutputKind`): CUMULATIVE or FINAL_ONLY (both give the whole output:
  `LLM` returns finished requests, the server streams its own deltas); DELTA is refused.
- `detokenize` False: token ids only (stop strings then refused); `spaces_between_special_tokens`.
- `seed`: a seeded request draws from its own generator, so it yields the same tokens whatever
  batch it shares. Seeds are 64-bit signed integers (vLLM's range); choice i of an n-choice
  request draws with `seed + i`, wrapped into that range (`choices`).

`__post_init__` normalises `stop` (a string becomes a one-item list), `stop_token_ids` (None
becomes an empty list), numbers (floats as float, integers as int, numpy scalars included) and
raises `SamplingParamError` (a ValueError) naming the bad field and what it allows: wrong types
(a string temperature, a bool `n`, a float token id) are refused, never coerced.

The field checks live in `vlmrun/sampling_fields.py`. `StopLimits` bounds what one request may ask of the stop-string matcher (stop strings, their length,
stop token ids); the front doors (server, `LLM`) check it with the limits of `EngineConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from vlmrun.sampling_fields import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, TOKEN_ID_MAX, RequestOutputKind,  # noqa: F401
                                    SamplingParamError, allowed_token_ids_field, bad_words_field, boolean_field,
                                    integer_field, is_integer, logit_bias_field, optional_field, output_kind_field,
                                    real_field, short_repr, stop_strings_field, token_ids_field)
from vlmrun.structured.params import StructuredOutputError, StructuredOutputsParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20  # top log-probabilities one token may return (vLLM's default max_logprobs)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed's signed 64-bit range


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
    structured_outputs: Optional[StructuredOutputsParams] = None
    thinking_token_budget: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None  # -1: the model's max_model_len
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    # each bad word's token sequences (`tokenize_bad_words` fills it; the sampler reads it)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = integer_field("n", self.n, lo=1)
        self.temperature = real_field("temperature", self.temperature, lo=0.0)
        self.top_p = real_field("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        self.top_k = integer_field("top_k", self.top_k, lo=-1, allowed="-1 or 0 (off) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = real_field("min_p", self.min_p, lo=0.0, hi=1.0)
        self.repetition_penalty = real_field("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        self.presence_penalty = real_field("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self.frequency_penalty = real_field("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        self.seed = optional_field(integer_field, "seed", self.seed, lo=SEED_MIN, hi=SEED_MAX,
                              allowed="a 64-bit signed integer (-2**63 to 2**63 - 1)")
        self.max_tokens = optional_field(integer_field, "max_tokens", self.max_tokens, lo=1)
        self.min_tokens = integer_field("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                                   f"({self.max_tokens})")
        self.stop = stop_strings_field(self.stop)
        self.stop_token_ids = token_ids_field("stop_token_ids", self.stop_token_ids)
        self.logit_bias = logit_bias_field(self.logit_bias)
        self.allowed_token_ids = allowed_token_ids_field(self.allowed_token_ids)
        self.bad_words = bad_words_field(self.bad_words)
        self.logprobs = optional_field(integer_field, "logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        self.thinking_token_budget = optional_field(integer_field, "thinking_token_budget", self.thinking_token_budget,
                                                    lo=0)
        self.prompt_logprobs = optional_field(integer_field, "prompt_logprobs", self.prompt_logprobs, lo=0,
                                              hi=MAX_LOGPROBS)
        self.truncate_prompt_tokens = optional_field(integer_field, "truncate_prompt_tokens",
                                                     self.truncate_prompt_tokens, lo=-1,
                                                     allowed="-1 (max_model_len) or a positive integer")
        if self.truncate_prompt_tokens == 0:
            raise SamplingParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or positive, got 0")
        self.output_kind = output_kind_field(self.output_kind)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            setattr(self, name, boolean_field(name, getattr(self, name)))
        if not self.detokenize and self.stop:
            raise SamplingParamError("detokenize", "stop strings need detokenize=True (they match the output text)")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            except StructuredOutputError as exc:
                raise SamplingParamError("structured_outputs", str(exc)) from None

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy, to change without touching this one."""
        return copy.deepcopy(self)

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
    def reads_output_tokens(self) -> bool:
        """True when sampling reads the request's generated token ids: a repetition, presence or
        frequency penalty other than the neutral one, or bad words."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.bad_words))

    @property
    def gates_reasoning(self) -> bool:
        """True when the engine tracks `<think>…</think>` for this request: its constraint holds only
        after the reasoning, or its reasoning has a token budget."""
        spec = self.structured_outputs
        return self.thinking_token_budget is not None or (spec is not None and spec.after_reasoning)

    def stop_ids_for(self, eos_token_ids: list[int] | tuple[int, ...]) -> list[int]:
        """Token ids that finish the request: EOS (unless ignore_eos) plus stop_token_ids."""
        ids = [] if self.ignore_eos else list(eos_token_ids)
        return ids + [t for t in self.stop_token_ids if t not in ids]

    def tokenize_bad_words(self, tokenizer: Any) -> "SamplingParams":
        """A copy with `bad_words_token_ids` filled by `tokenizer` (a Hugging Face tokenizer), or self
        without bad words. vLLM's rule: each word (leading spaces stripped) as it reads at the start of
        a text, and after a space when that form starts with another token and has as many tokens."""
        if not self.bad_words or self.bad_words_token_ids:  # none, or tokenized already (by the server)
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        copy = dataclasses.replace(self)
        copy.bad_words_token_ids = sequences
        return copy

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise SamplingParamError naming `logit_bias`, `allowed_token_ids` or `bad_words` when one of
        their token ids is outside the vocabulary [0, vocab_size)."""
        given = (("logit_bias", list(self.logit_bias or ())), ("allowed_token_ids", self.allowed_token_ids or []),
                 ("bad_words", [t for ids in self.bad_words_token_ids for t in ids]))
        for name, ids in given:
            outside = sorted({t for t in ids if t >= vocab_size})
            if outside:
                raise SamplingParamError(name, f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                                               f"{short_repr(outside)}")

    def choices(self) -> list["SamplingParams"]:
        """The `n` single-choice params of an n-choice request, one engine request each: n=1 and, when
        seeded, choice i draws with `seed + i` wrapped into the 64-bit range, so the n samples differ
        but repeat. The one place a request fans out into choices (`LLM`, the server)."""
        if self.n == 1:
            return [self]
        out = [dataclasses.replace(self, n=1, seed=None if self.seed is None else
                                   (self.seed + i - SEED_MIN) % 2**64 + SEED_MIN) for i in range(self.n)]
        for choice in out:  # bad words tokenized already stay so
            choice.bad_words_token_ids = self.bad_words_token_ids
        return out


@dataclass(frozen=True)
class StopLimits:
    """The most stop strings, characters per stop string and stop token ids one request may use.

    Stop strings cost the engine work on every generated token (bounded by their number and the
    longest one), so the server and `LLM` refuse requests beyond these (`EngineConfig` sets them).
    """

    max_stop_strings: int = 32
    max_stop_string_length: int = 512
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_length", "max_stop_token_ids"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, config: Any) -> "StopLimits":
        """The limits an `EngineConfig` sets."""
        return cls(config.max_stop_strings, config.max_stop_string_length, config.max_stop_token_ids)

    def check(self, params: SamplingParams) -> None:
        """Raise SamplingParamError (naming `stop` or `stop_token_ids`) past a limit."""
        stops = params.stop_strings
        if len(stops) > self.max_stop_strings:
            raise SamplingParamError("stop", f"stop has {len(stops)} strings; at most {self.max_stop_strings} "
                                             "are allowed")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_length:
            raise SamplingParamError("stop", f"stop strings may be at most {self.max_stop_string_length} "
                                             f"characters long, got one of {longest}")
        count = len(params.stop_token_ids or [])
        if count > self.max_stop_token_ids:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids has {count} ids; at most "
                                                       f"{self.max_stop_token_ids} are allowed")
