"""Cheap bounds on a request's prompt text, checked before anything tokenizes it: `PromptBounds`.

No token of the tokenizer is longer than `max_token_chars` characters (its longest vocabulary entry;
a byte-level BPE entry has one character per byte, and a character is at least one byte), so a text
of more than `max_model_len * max_token_chars` characters needs more than `max_model_len` tokens: it
can never run, and is a 400 (`context_length_exceeded`) before the tokenizer spends seconds and
gigabytes on it. A request that truncates its prompt (`truncate_prompt_tokens`) keeps only its end,
so it may send `TRUNCATED_FACTOR` times more. A prompt of token ids longer than the context is a 400
the same way, before its ids are checked one by one. The chat bound counts the text of the messages (what a
chat template always renders), never the media.

`is_heavy_text`: text over `LIGHT_TEXT_CHARS` (or more than `LIGHT_BAD_WORDS` bad words) is tokenized
in the media pool, not the light one, so that small requests never wait behind a large tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from vlmrun.server.errors import bad_request

LIGHT_TEXT_CHARS = 32 * 1024
LIGHT_BAD_WORDS = 64
TRUNCATED_FACTOR = 16


@dataclass(frozen=True)
class PromptBounds:
    max_model_len: int
    max_token_chars: int

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> "PromptBounds":
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
        return cls(max_model_len, max(1, longest))

    @property
    def max_chars(self) -> int:
        """More characters than this never fit the context."""
        return self.max_model_len * self.max_token_chars

    def check_prompt(self, prompt: Union[str, list[int]], truncating: bool, param: str) -> None:
        """400 when a text prompt is past the character bound, or a prompt of token ids is longer than the
        context (each before anything tokenizes or checks the prompt)."""
        if isinstance(prompt, str):
            self.check(len(prompt), truncating, param)
        elif len(prompt) > self.max_model_len * (TRUNCATED_FACTOR if truncating else 1):
            raise bad_request(f"the prompt has {len(prompt):,} token ids, more than this model's maximum context "
                              f"length of {self.max_model_len:,} tokens; shorten it", param=param,
                              code="context_length_exceeded")

    def check(self, chars: int, truncating: bool, param: str) -> None:
        """400 when a prompt of `chars` characters cannot fit the context (before it is tokenized)."""
        limit = self.max_chars * (TRUNCATED_FACTOR if truncating else 1)
        if chars > limit:
            cut = f" (x{TRUNCATED_FACTOR} with truncate_prompt_tokens)" if truncating else ""
            raise bad_request(f"the prompt has {chars:,} characters: more tokens than this model's maximum context "
                              f"length of {self.max_model_len:,} tokens (at most {self.max_chars:,} characters "
                              f"could fit{cut}); shorten it", param=param, code="context_length_exceeded")


def message_text_chars(messages: Any) -> int:
    """Characters of text in chat `messages` (string contents, text parts, tool-call arguments)."""
    total = 0
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():  # (another type: refused later, not a 500 here)
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                total += len(fn["arguments"])
    return total


def is_heavy_text(chars: int, bad_words: Any) -> bool:
    """Whether tokenizing `chars` characters of prompt and `bad_words` belongs in the media pool."""
    return chars > LIGHT_TEXT_CHARS or len(bad_words or ()) > LIGHT_BAD_WORDS
