"""Incremental detokenization and stop handling for one request.

Three pieces, plus one object that strings them together:

- `IncrementalDetokenizer` (`incremental_detokenizer.py`, re-exported here): `append(token_id) -> str`, the
  text the new token adds, complete characters only (a window decode through `tokenizers`' `DecodeStream`);
  `flush()` when the request ends; `extend` / `extend_and_flush` for many tokens at once, the same text.
- `StopStringMatcher` (`stop_strings.py`, re-exported here): fed the text piece by piece, finds the earliest stop-string occurrence that
  ends in the newest piece (the ones entirely in older text were checked before), returns where to
  cut the text (before the stop string, or after it with `include_stop_str_in_output`), and tells
  how much of the text is safe to stream: a tail that could still grow into a stop string is held
  back. It keeps one KMP automaton per stop string, so a piece costs O(its length x stop strings)
  however long the text grows; `find_stop_string` / `safe_length` are its whole-text forms.
- `check_stop(...)`: the token-level finish rules, vLLM/OpenAI style. Only a token after the first
  `min_tokens` outputs can stop the request (the sampler masks EOS / stop ids until then; length
  limits still apply). Then EOS (unless `ignore_eos`) or a `stop_token_ids` hit → "stop";
  `max_tokens` outputs or a full context → "length".
- `OutputTextStream`: per generated token, applies the three in vLLM's order and returns the
  delta to stream and the finish reason. The token that ended the request by EOS / stop token id
  is not detokenized unless `include_stop_str_in_output`; a stop string cuts the text; stop
  strings are checked only from output token `min_tokens + 1` on. The streamed deltas always concatenate
  to `.text`, the final output text (empty with `detokenize=False`: no token is decoded).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

from vlmrun.engine.incremental_detokenizer import IncrementalDetokenizer
from vlmrun.engine.stop_strings import StopMatch, StopStringMatcher, find_stop_string, safe_length
from vlmrun.sampling_params import SamplingParams

__all__ = ["FinishRules", "IncrementalDetokenizer", "OutputTextStream", "StopDecision", "StopMatch",
           "StopStringMatcher", "TokenUpdate", "check_stop", "find_stop_string", "safe_length"]


FINISH_STOP = "stop"
FINISH_LENGTH = "length"


# --------------------------------------------------------------------------------------------
# Token-level finish rules
# --------------------------------------------------------------------------------------------


class FinishRules(NamedTuple):
    """What lets a request's latest token end it, in plain fields a per-token loop tests inline: only a
    token after `min_tokens` outputs that is one of `stop_ids` (its stop token ids, and EOS unless
    `ignore_eos`), or the `length_cap`-th output (max_tokens or the context's room; sys.maxsize: none),
    can; `check_stop` then applies the full rules."""

    min_tokens: int
    stop_ids: frozenset
    length_cap: int

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: Sequence[int], num_prompt_tokens: int,
           max_model_len: Optional[int]) -> "FinishRules":
        stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        context_left = None if max_model_len is None else max_model_len - num_prompt_tokens
        limits = [n for n in (params.max_tokens, context_left) if n is not None]
        return cls(params.min_tokens, stop_ids, min(limits) if limits else sys.maxsize)


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str  # "stop" | "length"
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string; None for EOS / length


def check_stop(output_token_ids: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int],
               num_prompt_tokens: int = 0, max_model_len: Optional[int] = None) -> Optional[StopDecision]:
    """Finish decision after the last output token (stop strings are handled separately).

    Order (as vLLM): at most min_tokens outputs → keep going (unless length caps); EOS unless
    ignore_eos → "stop"; a stop_token_ids hit → "stop" (stop_reason = the id); max_tokens outputs
    or `num_prompt_tokens + outputs >= max_model_len` → "length".
    """
    n = len(output_token_ids)
    if n == 0:
        return None
    if n > params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            return StopDecision(FINISH_STOP)
        if last in params.stop_token_ids:
            return StopDecision(FINISH_STOP, stop_reason=last)
    if params.max_tokens is not None and n >= params.max_tokens:
        return StopDecision(FINISH_LENGTH)
    if max_model_len is not None and num_prompt_tokens + n >= max_model_len:
        return StopDecision(FINISH_LENGTH)
    return None


# --------------------------------------------------------------------------------------------
# Putting it together per request
# --------------------------------------------------------------------------------------------


class TokenUpdate(NamedTuple):
    """What one token added: made per request per step, so a tuple (cheaper to build than a frozen dataclass)."""

    delta: str  # text to stream now (may be "")
    finish_reason: Optional[str] = None  # "stop" | "length" | None (still running)
    stop_reason: Union[int, str, None] = None  # stop token id or stop string that ended it


class OutputTextStream:
    """Detokenize, check stops and hold back partial stop strings for one request.

    Call `add_token(token_id)` once per generated token, in order. Deltas concatenate to `.text`.
    A token costs O(its text x stop strings): only the new text goes through the stop matcher,
    and only the held-back tail (shorter than the longest stop string) is kept aside.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Sequence[int], max_model_len: Optional[int] = None) -> None:
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  params.spaces_between_special_tokens)
        self.matcher = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        self.finished: Optional[StopDecision] = None
        self._final_text: Optional[str] = None
        self._num_streamed = 0  # chars of the text already handed out
        self._held = ""  # text produced but held back: it may be the start of a stop string
        # a token can end the request (check_stop) only after min_tokens outputs, by one of these ids, or at
        # this many outputs: any other token skips check_stop
        rules = FinishRules.of(params, eos_token_ids, self.num_prompt_tokens, max_model_len)
        self._stop_ids, self._min_tokens, self._length_cap = rules.stop_ids, rules.min_tokens, rules.length_cap
        self._length_limit = None if rules.length_cap == sys.maxsize else rules.length_cap
        self._plain = params.detokenize and not self.matcher.stop  # every token: detokenize, stream the text
        self._append_text = self.detokenizer.append  # (bound once: add_plain_token calls it per token)

    @property
    def text(self) -> str:
        """The output text: final (cut at a stop string) once finished, else what is known so far."""
        return self._final_text if self._final_text is not None else self.detokenizer.text

    def final_text(self, output_token_ids: Sequence[int]) -> tuple[str, Union[int, str, None]]:
        """The finished request's text and stop reason (`FinalOutput.final_text`'s signature; the tokens came
        through `add_token` already)."""
        return self.text, None if self.finished is None else self.finished.stop_reason

    def add_plain_token(self, token_id: int) -> Optional[str]:
        """`add_token` for the common token: one that cannot end the request, of a request without stop
        strings (detokenized): its delta, the same text `add_token` gives. None, and nothing done, for any
        other token: the caller gives it to `add_token` (the full rules) instead."""
        outputs = self.output_token_ids
        n = len(outputs) + 1
        if not self._plain or (n > self._min_tokens and token_id in self._stop_ids) or n >= self._length_cap:
            return None
        outputs.append(token_id)
        new_text = self._append_text(token_id)
        self._num_streamed += len(new_text)
        return new_text

    def add_token(self, token_id: int) -> TokenUpdate:
        if self.finished is not None:
            raise RuntimeError("add_token called after the request finished")
        token_id = int(token_id)
        outputs = self.output_token_ids
        outputs.append(token_id)
        n, limit = len(outputs), self._length_limit
        decision = None
        if (n > self._min_tokens and token_id in self._stop_ids) or (limit is not None and n >= limit):
            decision = check_stop(outputs, self.params, self.eos_token_ids, self.num_prompt_tokens, self.max_model_len)
        if decision is None and self._plain:  # the common case: nothing to hold back or cut
            new_text = self.detokenizer.append(token_id)
            self._num_streamed += len(new_text)
            return TokenUpdate(new_text)
        if decision is None and not self.matcher.stop:  # detokenize=False
            return TokenUpdate("")
        stopped_by_token = decision is not None and decision.finish_reason == FINISH_STOP
        new_text = ""
        if self.params.detokenize and (not stopped_by_token or self.params.include_stop_str_in_output):
            new_text = self.detokenizer.append(token_id)
        if decision is not None and self.params.detokenize:
            new_text += self.detokenizer.flush()
        match = self._match_stop_string(new_text)
        if match is not None:
            decision = StopDecision(FINISH_STOP, stop_reason=match.stop)
        if decision is not None:
            return self._finish(decision, match)
        return TokenUpdate(self._take_safe_delta(new_text))

    def _match_stop_string(self, new_text: str) -> Optional[StopMatch]:
        if not self.matcher.stop:
            return None
        match = self.matcher.feed(new_text)  # fed always, so the matcher's view of the text stays whole
        if len(self.output_token_ids) <= self.params.min_tokens:
            return None
        return match

    def _finish(self, decision: StopDecision, match: Optional[StopMatch]) -> TokenUpdate:
        text = self.detokenizer.text
        if match is not None:
            text = text[:match.truncate_to]
        self._final_text = text
        self.finished = decision
        self._plain = False  # (a token after the end goes to add_token, which refuses it)
        delta = text[self._num_streamed:]
        self._num_streamed = len(text)
        self._held = ""
        return TokenUpdate(delta, decision.finish_reason, decision.stop_reason)

    def _take_safe_delta(self, new_text: str) -> str:
        pending = self._held + new_text
        keep = min(self.matcher.held_chars, len(pending))
        delta, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self._num_streamed += len(delta)
        return delta
