"""A chat choice's output text split into reasoning, content and tool calls, whole or as it streams.

- Reasoning (Qwen's `<think>…</think>`): text after a leading `<think>` (or from the start, when
  the prompt itself ended in `<think>`, as thinking templates do) up to `</think>` is
  `reasoning_content`; the newlines after `</think>` are dropped.
- Tool calls (when the parser is given the request's tools): each `<tool_call>…</tool_call>` block
  whose body `tool_calls.read_call` reads becomes a call; other text stays content. A call shows as
  soon as its name is known, and its arguments grow as they are written (a block cut off by the end
  of the output stays the call it had become, with the arguments as far as they went). Beside calls,
  the content's trailing whitespace (the newlines between parallel calls) is dropped; a stream holds
  trailing whitespace back until more content follows or the answer ends without a call, so streamed
  and collected content are the same.

`ChatOutputParser.feed(delta)` returns what became certain with that delta: a tail that might
still turn into a marker (`</think>`, `<tool_call>`, `</tool_call>`) or a call not yet named is held
back until the next delta or `finish()`. The parse is recomputed over the whole text each time and
only its growth is returned: new text, new calls (`CallDelta` with id and name, arguments "") and
pieces of arguments (`CallDelta` with the piece), so the streamed pieces always add up to the final
message, arguments included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from vlmrun.server.tool_calls import CALL_CLOSE, CALL_OPEN, ToolCall, held_back, read_call
from vlmrun.structured.reasoning import THINK_CLOSE, THINK_OPEN

logger = logging.getLogger(__name__)



@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class CallDelta:
    """A step of call `index`: its start (id and name, `arguments` "") or a piece of its arguments."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None

    @property
    def starts_call(self) -> bool:
        return self.name is not None

    def to_openai(self) -> dict[str, Any]:
        if self.starts_call:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class OutputDelta:
    """What one `feed` / `finish` adds: text pieces, new calls and pieces of arguments."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

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
        self._call_ids: list[str] = []  # each call keeps the id it was first sent with

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
                          _call_deltas(sent.calls, now.calls))
        self._sent = now
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
            if out.calls or not final:  # with calls, no trailing whitespace; while streaming, held back
                out.content = out.content.rstrip()
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
            out.reasoning = text if final else text[:len(text) - held_back(text, THINK_CLOSE)]
            return None
        out.reasoning = text[:end]
        return text[end + len(THINK_CLOSE):].lstrip("\n")

    def _split_calls(self, text: str, final: bool, out: ParsedOutput) -> None:
        while True:
            start = text.find(CALL_OPEN)
            if start < 0:
                out.content += text if final else text[:len(text) - held_back(text, CALL_OPEN)]
                return
            out.content += text[:start]
            end = text.find(CALL_CLOSE, start)
            body = text[start + len(CALL_OPEN):end if end >= 0 else len(text)]
            call = read_call(body, self.tools, closed=end >= 0)
            if call is not None:
                out.calls.append(self._call(call.name, call.arguments, len(out.calls)))
            elif end >= 0 or final:  # not a call: its text is content
                out.content += text[start:end + len(CALL_CLOSE) if end >= 0 else len(text)]
            if end < 0:  # unfinished: a call so far, or wait for more
                return
            text = text[end + len(CALL_CLOSE):]

    def _call(self, name: str, arguments: str, index: int) -> ToolCall:
        """The call at `index`, with the id it was first seen with."""
        if index == len(self._call_ids):
            self._call_ids.append(ToolCall(name, arguments).id)
        return ToolCall(name, arguments, self._call_ids[index])


def _call_deltas(sent: list[ToolCall], now: list[ToolCall]) -> list[CallDelta]:
    """The starts of calls not sent yet, then the growth of every call's arguments."""
    starts = [CallDelta(i, "", call.id, call.name) for i, call in enumerate(now) if i >= len(sent)]
    pieces = []
    for i, call in enumerate(now):
        before = sent[i].arguments if i < len(sent) else ""
        if len(call.arguments) > len(before):
            if not call.arguments.startswith(before):  # read_call only grows them: a bug
                logger.error("tool call %d: arguments %r do not extend the streamed %r", i, call.arguments, before)
                continue
            pieces.append(CallDelta(i, call.arguments[len(before):]))
    return starts + pieces
