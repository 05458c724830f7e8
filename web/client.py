"""A small async client for an OpenAI-compatible server: list models, stream a chat answer.

The demo needs only these two calls, so it speaks HTTP directly (httpx, which Gradio already
depends on) instead of pulling in the `openai` package. Closing the stream (the demo's Stop
button cancels the generator) closes the connection, and the server aborts the request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx


class ServerError(RuntimeError):
    """The server answered with an error (its message is shown to the user)."""


@dataclass
class StreamEvent:
    """One piece of a streamed answer; the last one has `finish_reason` and the usage counts."""

    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None


@dataclass
class Speed:
    """Timing of one answer, for the status line."""

    start: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    end: Optional[float] = None
    chunks: int = 0
    tokens: Optional[int] = None

    def observe(self, event: StreamEvent) -> None:
        now = time.monotonic()
        if event.text:
            self.chunks += 1
            if self.first_token is None:
                self.first_token = now
        if event.completion_tokens is not None:
            self.tokens = event.completion_tokens
            self.end = now

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.tokens is not None else self.chunks

    def tokens_per_second(self) -> float:
        elapsed = (self.end or time.monotonic()) - self.start
        return self.num_tokens / elapsed if elapsed > 0 else 0.0

    def describe(self) -> str:
        elapsed = (self.end or time.monotonic()) - self.start
        ttft = f", first token after {self.first_token - self.start:.2f} s" if self.first_token else ""
        approx = "" if self.tokens is not None else "~"
        return (f"{approx}{self.num_tokens} tokens in {elapsed:.2f} s · "
                f"**{self.tokens_per_second():.1f} tokens/s**{ttft}")


class ChatClient:
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def model_name(self) -> str:
        """The first model the server lists (synchronous: called once at start-up)."""
        r = httpx.get(self.base_url + "/models", headers=self.headers, timeout=30)
        _raise_for_error(r.status_code, r.content)
        data = r.json().get("data") or []
        if not data:
            raise ServerError("the server lists no model")
        return str(data[0]["id"])

    async def stream_chat(self, model: str, messages: list[dict[str, Any]],
                          params: dict[str, Any]) -> AsyncIterator[StreamEvent]:
        body = {"model": model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **params}
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            async with client.stream("POST", self.base_url + "/chat/completions", json=body,
                                     headers=self.headers) as response:
                if response.status_code != 200:
                    _raise_for_error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = _parse_chunk(json.loads(data))
                    if event is not None:
                        yield event


def _parse_chunk(chunk: dict[str, Any]) -> Optional[StreamEvent]:
    if "error" in chunk:
        raise ServerError(chunk["error"].get("message", "the server failed"))
    event = StreamEvent()
    for choice in chunk.get("choices") or []:
        event.text += (choice.get("delta") or {}).get("content") or ""
        event.finish_reason = choice.get("finish_reason") or event.finish_reason
    usage = chunk.get("usage")
    if usage:
        event.completion_tokens = usage.get("completion_tokens")
        event.prompt_tokens = usage.get("prompt_tokens")
    return event


def _raise_for_error(status: int, content: bytes) -> None:
    if status == 200:
        return
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:300].decode("utf-8", errors="replace")
    raise ServerError(f"HTTP {status}: {message}")
