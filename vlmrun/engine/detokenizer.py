"""Incremental detokenization and stop handling for one request.

Three pieces, plus one object that strings them together:

- `IncrementalDetokenizer.append(token_id) -> str`: the text the new token adds. It decodes only a
  short window (a few context tokens plus the not-yet-emitted ones), so a step costs O(window),
  not O(output length). While the window's text ends in U+FFFD (a multi-byte character split
  across tokens) it emits nothing and waits for the rest of the bytes; `flush()` gives up and
  emits what is held (used when the request ends). The deltas concatenate to
  `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers.
- `StopStringMatcher`: finds the earliest stop-string occurrence that overlaps the newest text
  (the ones entirely in older text were checked before), returns where to cut the text (before
  the stop string, or after it with `include_stop_str_in_output`), and tells how much of the text
  is safe to stream: a tail that could still grow into a stop string is held back.
- `check_stop(...)`: the token-level finish rules, vLLM/OpenAI style. Only a token after the first
  `min_tokens` outputs can stop the request (the sampler masks EOS / stop ids until then; length
  limits still apply). Then EOS (unless `ignore_eos`) or a `stop_token_ids` hit → "stop";
  `max_tokens` outputs or a full context → "length".
- `OutputTextStream`: per generated token, applies the three in vLLM's order and returns the
  delta to stream and the finish reason. The token that ended the request by EOS / stop token id
  is not detokenized unless `include_stop_str_in_output`; a stop string cuts the text; stop
  strings are checked only from output token `min_tokens + 1` on. The streamed deltas always concatenate
  to `.text`, the final output text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from vlmrun.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, so the first word decodes right

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


# --------------------------------------------------------------------------------------------
# Incremental detokenizer
# --------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Decode one token at a time; emit only complete characters.

    `tokens` = last few prompt tokens + output tokens. Text of `tokens[prefix_offset:read_offset]`
    was already emitted (it is kept as context); `tokens[read_offset:]` are pending.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))
        self._num_context = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """The full output text emitted so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_context:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens appended whose text is held back (an incomplete character)."""
        return len(self._tokens) - self._read_offset

    def append(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is incomplete)."""
        self._tokens.append(int(token_id))
        full = self._decode(self._prefix_offset, len(self._tokens))
        if full.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(full)

    def flush(self) -> str:
        """Emit whatever is held back (possibly ending in U+FFFD); call when the request ends."""
        if self.num_pending_tokens == 0:
            return ""
        return self._emit(self._decode(self._prefix_offset, len(self._tokens)))

    def _emit(self, full: str) -> str:
        """Text of the window beyond the emitted prefix becomes a delta (maybe ""); slide the window."""
        delta = full[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        return self.tokenizer.decode(self._tokens[start:end], skip_special_tokens=self.skip_special_tokens)


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    start: int  # index of its first character in the text
    truncate_to: int  # the output text becomes text[:truncate_to]


class StopStringMatcher:
    """Find stop strings in growing text; say how much of the text is safe to stream."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output

    def find(self, text: str, num_new_chars: int) -> Optional[StopMatch]:
        """Earliest stop occurrence ending inside the last `num_new_chars` chars of `text`.

        Earliest start wins; on a tie the one that ends first (the shorter) wins, as it would
        have completed first had the text arrived a character at a time.
        """
        if not self.stop or num_new_chars <= 0:
            return None
        old_len = len(text) - num_new_chars
        best: Optional[tuple[int, int, str]] = None  # (start, end, stop)
        for s in self.stop:
            idx = text.find(s, max(0, old_len - len(s) + 1))
            if idx < 0:
                continue
            cand = (idx, idx + len(s), s)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        start, end, s = best
        return StopMatch(stop=s, start=start, truncate_to=end if self.include_stop_str_in_output else start)

    def safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that no stop string can still claim.

        The longest tail of `text` that is a proper prefix of some stop string is held back.
        Nothing is held back with `include_stop_str_in_output`: a later match then cuts after
        the stop string, which never removes text already streamed.
        """
        if self.include_stop_str_in_output:
            return len(text)
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> Optional[StopMatch]:
    """Function form of `StopStringMatcher.find`."""
    return StopStringMatcher(stop, include_stop_str_in_output).find(text, num_new_chars)


# --------------------------------------------------------------------------------------------
# Token-level finish rules
# --------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class TokenUpdate:
    delta: str  # text to stream now (may be "")
    finish_reason: Optional[str] = None  # "stop" | "length" | None (still running)
    stop_reason: Union[int, str, None] = None  # stop token id or stop string that ended it


class OutputTextStream:
    """Detokenize, check stops and hold back partial stop strings for one request.

    Call `add_token(token_id)` once per generated token, in order. Deltas concatenate to `.text`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Sequence[int], max_model_len: Optional[int] = None) -> None:
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        self.finished: Optional[StopDecision] = None
        self._final_text: Optional[str] = None
        self._num_streamed = 0  # chars of the text already handed out

    @property
    def text(self) -> str:
        """The output text: final (cut at a stop string) once finished, else what is known so far."""
        return self._final_text if self._final_text is not None else self.detokenizer.text

    def add_token(self, token_id: int) -> TokenUpdate:
        if self.finished is not None:
            raise RuntimeError("add_token called after the request finished")
        self.output_token_ids.append(int(token_id))
        decision = check_stop(self.output_token_ids, self.params, self.eos_token_ids,
                              self.num_prompt_tokens, self.max_model_len)
        stopped_by_token = decision is not None and decision.finish_reason == FINISH_STOP
        new_text = ""
        if not stopped_by_token or self.params.include_stop_str_in_output:
            new_text = self.detokenizer.append(token_id)
        if decision is not None:
            new_text += self.detokenizer.flush()
        match = self._match_stop_string(new_text)
        if match is not None:
            decision = StopDecision(FINISH_STOP, stop_reason=match.stop)
        if decision is not None:
            return self._finish(decision, match)
        return TokenUpdate(self._take_safe_delta())

    def _match_stop_string(self, new_text: str) -> Optional[StopMatch]:
        if len(self.output_token_ids) <= self.params.min_tokens:
            return None
        return self.matcher.find(self.detokenizer.text, len(new_text))

    def _finish(self, decision: StopDecision, match: Optional[StopMatch]) -> TokenUpdate:
        text = self.detokenizer.text
        if match is not None:
            text = text[:match.truncate_to]
        self._final_text = text
        self.finished = decision
        delta = text[self._num_streamed:]
        self._num_streamed = len(text)
        return TokenUpdate(delta, decision.finish_reason, decision.stop_reason)

    def _take_safe_delta(self) -> str:
        text = self.detokenizer.text
        safe = self.matcher.safe_length(text) if self.matcher.stop else len(text)
        if safe <= self._num_streamed:
            return ""
        delta = text[self._num_streamed:safe]
        self._num_streamed = safe
        return delta
