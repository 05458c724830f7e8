"""A chat choice's output text split into reasoning, content and tool calls, whole or as it streams.

- Reasoning (Qwen's `<think>…</think>`): text after a leading `<think>` (or from the start, when
  the prompt itself ended in `<think>`, as thinking templates do) up to `</think>` is
  `reasoning_content`; the newlines after `</think>` are dropped.
- Tool calls (when the parser is given the request's tools): each complete `<tool_call>…</tool_call>`
  block whose body `tool_calls.parse_call` reads becomes a call; other text stays content.

`ChatOutputParser.feed(delta)` returns what became certain with that delta: a tail that might
still turn into a marker (`</think>`, `<tool_call>`) or an unfinished call is held back until
the next delta or `finish()`. The parse is recomputed over the whole text each time and only
its growth is returned, so the streamed pieces always add up to the final message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from vlmrun.server.tool_calls import CALL_CLOSE, CALL_OPEN, ToolCall, parse_call

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class OutputDelta:
    """What one `feed` / `finish` adds: text pieces and newly completed calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: "OutputDelta") -> "OutputDelta":
        return OutputDelta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class ChatOutputParser:
    def __init__(self, reasoning: bool, tools: Sequence[dict[str, Any]] = (), prompt_text: str = ""):
        self.reasoning = reasoning
        self.tools = tools
        self.starts_in_reasoning = reasoning and prompt_text.rstrip().endswith(THINK_OPEN)
        self.text = ""
        self._sent = ParsedOutput()

    @property
    def active(self) -> bool:
        """False when the parser passes text through unchanged (nothing to split)."""
        return self.reasoning or bool(self.tools)

    @property
    def num_calls(self) -> int:
        """Tool calls returned so far."""
        return len(self._sent.calls)

    def feed(self, delta: str) -> OutputDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> OutputDelta:
        return self._advance(final=True)

    def parse_all(self, text: str) -> ParsedOutput:
        """The whole output at once (non-streamed responses)."""
        self.text = text
        self._advance(final=True)
        return self._sent

    def _advance(self, final: bool) -> OutputDelta:
        now = self._parse(final)
        sent = self._sent
        out = OutputDelta(now.reasoning[len(sent.reasoning):], now.content[len(sent.content):],
                          now.calls[len(sent.calls):])
        sent.reasoning, sent.content = now.reasoning, now.content
        sent.calls.extend(out.calls)
        return out

    def _parse(self, final: bool) -> ParsedOutput:
        out = ParsedOutput()
        rest = self.text
        if self.reasoning:
            rest = self._split_reasoning(rest, final, out)
            if rest is None:
                return out
        if self.tools:
            self._split_calls(rest, final, out)
        else:
            out.content = rest
        return out

    def _split_reasoning(self, text: str, final: bool, out: ParsedOutput) -> Optional[str]:
        """Fill `out.reasoning`; the text after the reasoning, or None while it is still unfinished."""
        in_reasoning = self.starts_in_reasoning
        if text.startswith(THINK_OPEN):
            text, in_reasoning = text[len(THINK_OPEN):], True
        elif not final and not in_reasoning and THINK_OPEN.startswith(text):
            return None  # "<thi" may still become "<think>"
        if not in_reasoning:
            return text
        end = text.find(THINK_CLOSE)
        if end < 0:
            out.reasoning = text if final else text[:len(text) - _held_back(text, THINK_CLOSE)]
            return None
        out.reasoning = text[:end]
        return text[end + len(THINK_CLOSE):].lstrip("\n")

    def _split_calls(self, text: str, final: bool, out: ParsedOutput) -> None:
        while True:
            start = text.find(CALL_OPEN)
            if start < 0:
                out.content += text if final else text[:len(text) - _held_back(text, CALL_OPEN)]
                return
            out.content += text[:start]
            end = text.find(CALL_CLOSE, start)
            if end < 0:  # unfinished: wait for the rest, or keep it as content at the end
                if final:
                    out.content += text[start:]
                return
            block_end = end + len(CALL_CLOSE)
            call = parse_call(text[start + len(CALL_OPEN):end], self.tools)
            if call is None:
                out.content += text[start:block_end]
            else:
                out.calls.append(self._known_call(call, len(out.calls)))
            text = text[block_end:]

    def _known_call(self, call: ToolCall, index: int) -> ToolCall:
        """The call at `index` keeps the id it was first sent with."""
        return self._sent.calls[index] if index < len(self._sent.calls) else call


def _held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
