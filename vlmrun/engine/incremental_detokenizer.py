"""Incremental detokenization of one request's output tokens: `IncrementalDetokenizer`.

`append(token_id) -> str` is the text the new token adds. It decodes only a short window (a few context
tokens plus the not-yet-emitted ones), so a step costs O(window), not O(output length); with a fast
tokenizer `tokenizers.decoders.DecodeStream` does it in Rust. While the window's text ends in U+FFFD (a
multi-byte character split across tokens) it emits nothing and waits for the rest of the bytes; `flush()`
gives up and emits what is held (used when the request ends). The deltas concatenate to
`tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers.
`extend(token_ids)` appends many tokens with the same text as `append` one at a time, and
`extend_and_flush(token_ids)` (a finished request's text) the text `extend` and then `flush` give: both in
one decode of the output (`text_after`) where that provably gives the same text, else token by token. `detokenizer.py` strings it together with the stop rules per request.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, so the first word decodes right


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
        self._backend = _stream_backend(tokenizer) if spaces_between_special_tokens else None
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if prompt_token_ids else []
        if self._backend is not None:
            context, _ = whole_character_context(self._backend, context, skip_special_tokens)
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: Optional[str] = None  # decode of tokens[prefix_offset:read_offset], made when needed
        self._num_context = len(context)
        self._pieces: list[str] = []  # the deltas; joined on demand (appending to one str is quadratic)
        self._stream = (None if self._backend is None
                        else DecodeStream(ids=context, skip_special_tokens=skip_special_tokens))
        # a byte-level decoder's text is the UTF-8 (lossy) of its tokens' bytes, joined: `text_after` relies on it
        self._byte_level = _is_byte_level(self._backend)

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

    def _extend_at_once(self, token_ids: list[int]) -> bool:
        """`extend` in one decode (`_at_once`) when the new text is whole: no U+FFFD in it, so the per-token
        stream would have emitted all of it, ending at the last token (nothing held back); refused otherwise,
        and when it adds no text (skipped special tokens stay pending in the per-token way)."""
        return self._at_once(token_ids, lambda added: bool(added) and REPLACEMENT_CHAR not in added)

    def extend_and_flush(self, token_ids: Sequence[int]) -> None:
        """`extend(token_ids)`, then `flush()`: the text of a request that ends with these tokens. With a
        byte-level decoder whose emitted window ends on a whole character (a fresh one's context always does:
        `whole_character_context`), one decode of the output (two `decode` calls: `_at_once`), U+FFFD
        in it or not; otherwise extend, then flush."""
        token_ids = list(map(int, token_ids))
        if not self._at_once(token_ids, lambda added: True):
            self.extend(token_ids)
            self.flush()

    def _at_once(self, token_ids: list[int], takes: Callable[[str], bool]) -> bool:
        """The text `append` per token gives (and `flush` after it), from one decode of the window and
        `token_ids` (`text_after`), when `takes(added text)`.

        Why it is the same: a byte-level decoder's text of a run of tokens is the lossy UTF-8 of their bytes,
        joined, and lossy UTF-8 decoding can be cut after a whole character: decode(a + b) = decode(a) +
        decode(b) when decode(a) ends in a character other than U+FFFD (every byte of `a` was taken into
        it; the decoder starts `b` afresh). The emitted window ends so (`text_after` checks it). A per-token
        step emits only when its window's text does not end in U+FFFD, so each point where it emits is such
        a cut too, its window text always extends its prefix (the stream never raises), and `flush` emits the
        text from the last such point to the end: the deltas join to decode(window + ids) minus
        decode(window); without the flush, the same when that text has no U+FFFD (the last token emitted).
        Refused (False, nothing changed): no ids, not byte-level, no stream, held-back tokens, a window ending
        in U+FFFD, a decode that raises, `takes` false. After it the stream starts over after the tokens, as
        `flush` leaves it (the window ends on a whole character: the same text from there on)."""
        if not token_ids or not self._byte_level or self._stream is None or self.num_pending_tokens:
            return False
        window, skip = self._tokens[self._prefix_offset:self._read_offset], self.skip_special_tokens
        added = text_after(self._backend, window, token_ids, skip)
        if added is None or not takes(added):
            return False
        self._tokens.extend(token_ids)
        if added:
            self._pieces.append(added)
        self._slide()
        self._stream = DecodeStream(ids=self._tokens[-CONTEXT_TOKENS:], skip_special_tokens=skip)
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


def finished_text(tokenizer: Any, context: list[int], token_ids: list[int], skip_special_tokens: bool = True,
                  spaces_between_special_tokens: bool = True, flush: bool = True) -> str:
    """The text an `IncrementalDetokenizer` over `context` (a prompt's last tokens) gives for `token_ids`, then
    `flush` (`flush` False: `extend` alone): a finished request's text. With a byte-level backend and a flush,
    `text_after` over the trimmed context directly (what `extend_and_flush` does, without building the
    detokenizer and its streams); else, or when that is refused, through the detokenizer."""
    backend = _stream_backend(tokenizer) if spaces_between_special_tokens else None
    if flush and token_ids and _is_byte_level(backend):
        context, context_text = whole_character_context(backend, context, skip_special_tokens)
        added = text_after(backend, context, token_ids, skip_special_tokens, context_text)
        if added is not None:
            return added
    detokenizer = IncrementalDetokenizer(tokenizer, context, skip_special_tokens, spaces_between_special_tokens)
    if flush:
        detokenizer.extend_and_flush(token_ids)
    else:
        detokenizer.extend(token_ids)
    return detokenizer.text


def text_after(backend: Tokenizer, window: list[int], token_ids: list[int], skip_special_tokens: bool,
               window_text: Optional[str] = None) -> Optional[str]:
    """decode(window + token_ids) minus decode(window), in two `decode` calls of a byte-level `backend` (one when
    `window_text`, the window's decode, is given), when the window's text ends on a whole character (not in
    U+FFFD): then it is the text per-token `append` and `flush` give after that window
    (`IncrementalDetokenizer._at_once` says why). None otherwise, or when a decode raises."""
    try:
        prefix = backend.decode(window, skip_special_tokens=skip_special_tokens) if window_text is None else window_text
        if prefix.endswith(REPLACEMENT_CHAR):  # (refused before the longer decode)
            return None
        full = backend.decode(window + token_ids, skip_special_tokens=skip_special_tokens)
    except Exception:  # noqa: BLE001 - the caller goes token by token instead
        return None
    return full[len(prefix):] if full.startswith(prefix) else None


def whole_character_context(backend: Tokenizer, context: list[int], skip_special_tokens: bool) -> tuple[list[int], str]:
    """`context` (a prompt's last tokens) less the trailing tokens whose text ends inside a character (in U+FFFD),
    and its text: the output's text then starts on a whole character, as the output ids decoded alone (HF's text)
    do. A stream primed with a context ending in U+FFFD does not keep that text as its prefix: its first piece
    would carry the prompt's own text."""
    text = backend.decode(context, skip_special_tokens=skip_special_tokens)
    while context and text.endswith(REPLACEMENT_CHAR):
        context = context[:-1]
        text = backend.decode(context, skip_special_tokens=skip_special_tokens)
    return context, text


def _is_byte_level(backend: Optional[Tokenizer]) -> bool:
    """Whether `backend`'s decoder is byte-level (where `text_after` applies)."""
    return backend is not None and isinstance(backend.decoder, ByteLevel)


def _stream_backend(tokenizer: Any) -> Optional[Tokenizer]:
    """The `tokenizers.Tokenizer` whose decode is `tokenizer.decode`'s whole work (transformers' fast
    tokenizers without space clean-up), or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend
