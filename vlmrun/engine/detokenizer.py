"""Incremental detokenization and stop handling for one request.

Three pieces, plus one object that strings them together:

- `IncrementalDetokenizer.append(token_id) -> str`: the text the new token adds. It decodes only a
  short window (a few context tokens plus the not-yet-emitted ones), so a step costs O(window),
  not O(output length); with a fast tokenizer `tokenizers.decoders.DecodeStream` does it in Rust. While the window's text ends in U+FFFD (a multi-byte character split
  across tokens) it emits nothing and waits for the rest of the bytes; `flush()` gives up and
  emits what is held (used when the request ends). The deltas concatenate to
  `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers.
  `extend(token_ids)` appends many tokens with the same text as `append` one at a time: in one
  `DecodeStream.step` call (a list of ids) where that provably gives the same text, else token by token;
  `extend_and_flush(token_ids)` (a finished request's text) in one `decode` where that provably gives
  what `extend` and then `flush` give.
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

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from vlmrun.engine.stop_strings import StopMatch, StopStringMatcher, find_stop_string, safe_length
from vlmrun.sampling_params import SamplingParams

__all__ = ["FinishRules", "IncrementalDetokenizer", "OutputTextStream", "StopDecision", "StopMatch", "StopStringMatcher",
           "TokenUpdate", "check_stop", "find_stop_string", "safe_length"]

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

    With a `tokenizers`-backed tokenizer (transformers' fast tokenizers) each token goes through
    `tokenizers.decoders.DecodeStream`, which runs the same window logic in Rust (no Python wrapping
    per token); other tokenizers, `spaces_between_special_tokens=False` (an option only HF's slow
    tokenizers read) and a tokenizer whose `decode` cleans up spaces take the window decode through
    `tokenizer.decode` here. A stream that fails (a decoder whose window text does not extend its
    prefix) falls back to the window decode from where it stood.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens  # HF's option (slow tokenizers read it)
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: Optional[str] = None  # decode of tokens[prefix_offset:read_offset], made when needed
        self._num_context = len(context)
        self._pieces: list[str] = []  # the deltas; joined on demand (appending to one str is quadratic)
        self._backend = _stream_backend(tokenizer) if spaces_between_special_tokens else None
        self._stream = (None if self._backend is None
                        else DecodeStream(ids=context, skip_special_tokens=skip_special_tokens))
        # a byte-level decoder's text is the UTF-8 (lossy) of its tokens' bytes, joined: `extend` relies on it
        self._byte_level = self._backend is not None and isinstance(self._backend.decoder, ByteLevel)

    @property
    def text(self) -> str:
        """The full output text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_context:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens appended whose text is held back (an incomplete character)."""
        return len(self._tokens) - self._read_offset

    def append(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is incomplete)."""
        token_id = int(token_id)
        self._tokens.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - the window decode below gives the text from here on
                self._stream = None
            else:
                if piece is None:  # an incomplete character, or no new text (a skipped special token)
                    return ""
                self._prefix_offset = self._read_offset  # (`_slide`, inline: once per token)
                self._read_offset = len(self._tokens)
                self._prefix_text = None
                self._pieces.append(piece)
                return piece
        full = self._decode(self._prefix_offset, len(self._tokens))
        if full.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(full)

    def extend(self, token_ids: Sequence[int]) -> None:
        """`append` each of `token_ids`, in order: the same text, in one `tokenizers` call where that is
        provably the same (`_extend_at_once`), else token by token (a stream that raises falls back as
        in `append`). The deltas are not returned: read `text`."""
        token_ids = list(map(int, token_ids))
        if self._extend_at_once(token_ids):
            return
        done = self._extend_by_stream(token_ids) if self._stream is not None else 0
        for token_id in token_ids[done:]:  # (the stream raised, or there is none: the window decode)
            self.append(token_id)

    def _extend_by_stream(self, token_ids: Sequence[int]) -> int:
        """`append`'s stream path over `token_ids`, one `DecodeStream.step` each in a tight loop; returns how
        many it took: all, or up to the one the stream raised on (the stream is then dropped, as `append`
        drops it, and the caller appends that one and the rest by the window decode)."""
        step, backend, tokens, pieces = self._stream.step, self._backend, self._tokens, self._pieces
        prefix, read = self._prefix_offset, self._read_offset
        done = 0
        for token_id in token_ids:
            tokens.append(token_id)
            try:
                piece = step(backend, token_id)
            except Exception:  # noqa: BLE001 - as in append: the window decode from here on
                tokens.pop()
                self._stream = None
                break
            done += 1
            if piece is not None:
                prefix, read = read, len(tokens)
                pieces.append(piece)
        if (prefix, read) != (self._prefix_offset, self._read_offset):
            self._prefix_offset, self._read_offset, self._prefix_text = prefix, read, None
        return done

    def _extend_at_once(self, token_ids: Sequence[int]) -> bool:
        """One `DecodeStream.step(tokenizer, ids)` over the whole list, kept only when it gives what the
        per-token steps give: with a byte-level decoder the text of a run of tokens is the lossy UTF-8 of
        their bytes, joined. When the emitted window's text (the context) and the new text have no U+FFFD,
        those bytes are valid UTF-8 from the window's start, every point where a per-token step emits is a
        character boundary, and the per-token deltas are the substrings between them: they join to the
        one step's text. Otherwise (U+FFFD, a held-back tail, no new text, an error) nothing is changed and
        the caller steps token by token. Tried on a stream of its own, so a refusal leaves this one as it was."""
        if not token_ids or not self._byte_level or self._stream is None or self.num_pending_tokens:
            return False
        window = self._tokens[self._prefix_offset:self._read_offset]
        if REPLACEMENT_CHAR in self._backend.decode(window, skip_special_tokens=self.skip_special_tokens):
            return False
        stream = DecodeStream(ids=window, skip_special_tokens=self.skip_special_tokens)
        try:
            piece = stream.step(self._backend, token_ids)
        except Exception:  # noqa: BLE001 - token by token instead (with append's fallback)
            return False
        if piece is None or REPLACEMENT_CHAR in piece:
            return False
        self._tokens.extend(token_ids)
        self._stream = stream
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = None
        self._pieces.append(piece)
        return True

    def extend_and_flush(self, token_ids: Sequence[int]) -> None:
        """`extend(token_ids)`, then `flush()`: the text of a request that ends with these tokens. With a
        byte-level decoder whose emitted window ends on a whole character, one `decode` gives it, U+FFFD or
        not (`_flush_at_once`). A window that ends inside a character (a prompt's last tokens may) takes
        tokens one at a time until the stream emits, after which the window ends on a whole character and
        one decode gives the rest; otherwise extend, then flush."""
        token_ids = list(map(int, token_ids))
        if self._flush_at_once(token_ids):
            return
        done = self._append_until_emitted(token_ids)
        if done < len(token_ids) and self._flush_at_once(token_ids[done:]):
            return
        self.extend(token_ids[done:])
        self.flush()

    def _append_until_emitted(self, token_ids: Sequence[int]) -> int:
        """`append` tokens until one emits text (or the list ends); returns how many it took."""
        read_offset = self._read_offset
        for done, token_id in enumerate(token_ids, 1):
            self.append(token_id)
            if self._read_offset != read_offset:
                return done
        return len(token_ids)

    def _flush_at_once(self, token_ids: list[int]) -> bool:
        """The text `append` per token and then `flush` give, from one decode of the window and `token_ids`.

        Why it is the same: a byte-level decoder's text of a run of tokens is the lossy UTF-8 of their bytes,
        joined, and lossy UTF-8 decoding can be cut after a whole character: decode(a + b) = decode(a) +
        decode(b) when decode(a) ends in a character other than U+FFFD (every byte of `a` was taken into
        it; the decoder starts `b` afresh). The emitted window ends so (checked here). A per-token step emits
        only when its window's text does not end in U+FFFD, so each point where it emits is such a cut too,
        its window text always extends its prefix (the stream never raises), and `flush` emits the text
        from the last such point to the end. The deltas therefore join to decode(window + ids) minus
        decode(window). Refused (False, nothing changed): no ids, not byte-level, no stream, held-back
        tokens, a window ending in U+FFFD, a decode that raises."""
        if not token_ids or not self._byte_level or self._stream is None or self.num_pending_tokens:
            return False
        window, skip = self._tokens[self._prefix_offset:self._read_offset], self.skip_special_tokens
        try:
            prefix = self._backend.decode(window, skip_special_tokens=skip)
            full = self._backend.decode(window + token_ids, skip_special_tokens=skip)
        except Exception:  # noqa: BLE001 - token by token instead (with append's fallback)
            return False
        if prefix.endswith(REPLACEMENT_CHAR) or not full.startswith(prefix):
            return False
        self._tokens.extend(token_ids)
        if len(full) > len(prefix):
            self._pieces.append(full[len(prefix):])
        self._slide()
        self._stream = DecodeStream(ids=self._tokens[-CONTEXT_TOKENS:], skip_special_tokens=skip)  # as flush leaves it
        return True

    def flush(self) -> str:
        """Emit whatever is held back (possibly ending in U+FFFD); call when the request ends."""
        if self.num_pending_tokens == 0:
            return ""
        delta = self._emit(self._decode(self._prefix_offset, len(self._tokens)))
        if self._stream is not None:  # the stream starts over after the emitted tokens
            self._stream = DecodeStream(ids=self._tokens[-CONTEXT_TOKENS:], skip_special_tokens=self.skip_special_tokens)
        return delta

    def _emit(self, full: str) -> str:
        """Text of the window beyond the emitted prefix becomes a delta (maybe ""); slide the window."""
        delta = full[len(self._emitted_prefix()):]
        self._slide()
        if delta:
            self._pieces.append(delta)
        return delta

    def _emitted_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._prefix_text

    def _slide(self) -> None:
        """Everything appended is emitted: the window's context starts where the last emission ended."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = None

    def _decode(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        options = {} if self.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(self._tokens[start:end], skip_special_tokens=self.skip_special_tokens,
                                     **options)  # the option only when asked: HF's default is True


def _stream_backend(tokenizer: Any) -> Optional[Tokenizer]:
    """The `tokenizers.Tokenizer` whose decode is `tokenizer.decode`'s whole work (transformers' fast
    tokenizers without space clean-up), or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


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
