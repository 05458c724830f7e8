"""HTTP plumbing the handlers share: a capped JSON body read, and client-disconnect handling.

A client that goes away must not keep its request running. Two cases:

- non-streaming: `until_done_or_disconnected` runs the work beside a task that waits for the
  ASGI `http.disconnect` message; a disconnect cancels the work (whose `finally` aborts the
  engine requests) and raises `ClientDisconnected`;
- streaming: `SSEResponse` pumps the event stream and listens for the disconnect at the same
  time, so a client that leaves while the engine is still in prefill (nothing to send yet) is
  noticed at once, not at the next write. Either way the event generator is closed, and its
  `finally` aborts what is left.

A failed `work` (a refused image or video) leaves no reference cycle behind: the error's traceback holds
the frame that awaited the task, and the task holds the error, so a frame that kept the task would keep
the whole chain (the refused media's decoder and bytes among its frames' locals) until the cyclic garbage
collector's next full pass, which on a server's large heap may be minutes away.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlmrun.server.errors import not_json, too_large

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


def is_json(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, parameters (charset) aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json_body(request: Request, limit: int) -> bytes:
    """The request body of a JSON route: 415 unless it says it is JSON (before reading it), 413 as soon
    as it is known to exceed `limit` bytes."""
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        raise not_json(content_type)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-upload: a 499, not a server error
        raise ClientDisconnected() from None
    return b"".join(chunks)


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        try:
            return task.result()
        finally:  # the error's traceback holds this frame: no frame -> task -> error cycle (see the docstring)
            del task, done, watcher
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose generator is closed as soon as the client disconnects.

    `on_close` runs once the response is over, however it ended (even if the generator never
    started), so the handler's cleanup cannot be skipped.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Optional[Callable[[], None]] = None,
                 headers: Optional[dict[str, str]] = None):
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers={**base, **(headers or {})})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:
                pump.cancel()
            try:
                await pump
            except (asyncio.CancelledError, OSError):
                pass
        finally:
            watcher.cancel()
            pump.cancel()
            aclose: Any = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:  # also when the generator never started
                self._on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
