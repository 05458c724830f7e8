"""Response bodies of the OpenAI API: chat completions, text completions, their stream chunks,
logprobs in both formats, usage.

Everything here is a pure function of collected output; the handlers decide when to send what.
A token's text in logprobs is `tokenizer.decode([token_id])` (a token that is part of a multi-byte
character decodes to U+FFFD; its `bytes` are then those of that replacement text). A logprob JSON
cannot hold is written as vLLM writes it: -inf as -9999.0, NaN and +inf (a model gone wrong) as null,
in collected answers and streams alike (`json_logprob`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from vlmrun.engine.request_group import FINISH_ABORT


@dataclass
class ChoiceState:
    """One choice as collected so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # SamplingParams.prompt_logprobs, when asked
    parsed: Optional[Any] = None  # chat_output.ParsedOutput when reasoning / tool calls were split out
    streamed: bool = False  # a stream chunk of this choice has been sent


class TokenText:
    """Token id → text for logprobs, cached per response; "token_id:<id>" instead with `as_token_ids`
    (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.decoded(token_id)

    def decoded(self, token_id: int) -> str:
        """The token's own text, whatever `as_token_ids` says."""
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def client_finish_reason(reason: Optional[str]) -> Optional[str]:
    """The engine's reasons are OpenAI's ("stop", "length"); an abort reads as "stop" if ever seen."""
    return "stop" if reason == FINISH_ABORT else reason


def with_tool_calls(reason: Optional[str], num_calls: int) -> Optional[str]:
    """A choice that ended normally after making tool calls finishes with "tool_calls"."""
    return "tool_calls" if reason == "stop" and num_calls else reason


def sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


SSE_DONE = sse("[DONE]")


# ---------------------------------------------------------------------------- logprobs


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top: int,
                  token_text: TokenText) -> dict[str, Any]:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        text = token_text(tid)
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({
            "token": text, "logprob": json_logprob(lp.get(tid)), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": json_logprob(v),
                              "bytes": list(token_text(t).encode("utf-8"))} for t, v in ranked],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], logprobs: list[Optional[dict[int, float]]], top: int,
                        token_text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """The legacy format; a position without logprobs (an echoed prompt's first token) has null ones."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, lp in zip(token_ids, logprobs):
        text = token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(json_logprob(lp.get(tid)))
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        tops.append({token_text(t): json_logprob(v) for t, v in ranked})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def json_logprob(value: Optional[float]) -> Optional[float]:
    """A logprob as JSON holds it: -inf (an impossible token) clamped to -9999.0, NaN and +inf null."""
    if value is None:
        return -9999.0
    value = float(value)
    if math.isnan(value) or value == math.inf:
        return None
    return max(value, -9999.0)


# ---------------------------------------------------------------------------- chat


def chat_completion(rid: str, created: int, model: str, choices: list[ChoiceState], want_logprobs: bool,
                    top: int, token_text: TokenText, prompt_tokens: int) -> dict[str, Any]:
    out = []
    for c in choices:
        out.append({
            "index": c.index,
            "message": chat_message(c),
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, top, token_text) if want_logprobs else None,
            "finish_reason": client_finish_reason(with_tool_calls(c.finish_reason,
                                                                  len(c.parsed.calls) if c.parsed else 0)),
            "stop_reason": c.stop_reason,
        })
    completion = sum(len(c.token_ids) for c in choices)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_tokens, completion), "system_fingerprint": None}


def chat_message(c: ChoiceState) -> dict[str, Any]:
    """The assistant message: the text, or its content, reasoning and tool calls when split."""
    if c.parsed is None:
        return {"role": "assistant", "content": c.text, "refusal": None, "tool_calls": []}
    calls = [call.to_openai() for call in c.parsed.calls]
    content = c.parsed.content  # beside calls, without trailing whitespace (`chat_output.py`)
    message = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None,
               "tool_calls": calls}
    if c.parsed.reasoning:
        message["reasoning_content"] = c.parsed.reasoning
    return message


def chat_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
               include_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": choices, "system_fingerprint": None}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any], logprobs: Optional[dict[str, Any]] = None,
                      finish_reason: Optional[str] = None, stop_reason: Union[int, str, None] = None) -> dict[str, Any]:
    """One choice of a chat chunk; the chunk that finishes it carries its `stop_reason` too (vLLM's)."""
    out = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": client_finish_reason(finish_reason)}
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    return out


# ---------------------------------------------------------------------------- completions


@dataclass(frozen=True)
class CompletionEcho:
    """Completions' `echo`: each choice's prompt text goes before its answer (`prefixes`), and with logprobs
    the prompt tokens' logprobs before the answer's; `only`: the prompt alone (max_tokens 0)."""

    prefixes: list[str]
    only: bool = False

    def text(self, c: ChoiceState) -> str:
        return self.prefixes[c.index] + ("" if self.only else c.text)

    def logprobs(self, c: ChoiceState) -> tuple[list[int], list[Optional[dict[int, float]]]]:
        """The echoed tokens and their logprobs: the prompt's (the first has none), then the answer's."""
        prompt = c.prompt_logprobs or [None] * len(c.prompt_token_ids)
        if self.only:
            return list(c.prompt_token_ids), list(prompt)
        return [*c.prompt_token_ids, *c.token_ids], [*prompt, *c.logprobs]


def text_completion(rid: str, created: int, model: str, choices: list[ChoiceState], logprobs: Optional[int],
                    token_text: TokenText, echo: Optional[CompletionEcho], prompt_tokens: int) -> dict[str, Any]:
    out = []
    for c in choices:
        ids, lps = echo.logprobs(c) if echo is not None else (c.token_ids, c.logprobs)
        lp = completion_logprobs(ids, lps, logprobs, token_text) if logprobs is not None else None
        out.append({"index": c.index, "text": echo.text(c) if echo is not None else c.text, "logprobs": lp,
                    "finish_reason": client_finish_reason(c.finish_reason), "stop_reason": c.stop_reason})
    completion = sum(len(c.token_ids) for c in choices)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_tokens, completion), "system_fingerprint": None}


def completion_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                     include_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "system_fingerprint": None}
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk_choice(index: int, text: str, logprobs: Optional[dict[str, Any]] = None,
                            finish_reason: Optional[str] = None,
                            stop_reason: Union[int, str, None] = None) -> dict[str, Any]:
    """One choice of a completions chunk; the chunk that finishes it carries its `stop_reason` too (vLLM's)."""
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": client_finish_reason(finish_reason)}
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    return out


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}


def error_event(message: str, kind: str = "server_error", code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
