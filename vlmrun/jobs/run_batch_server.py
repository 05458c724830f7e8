"""The OpenAI server's own app, answering `vlmrun run-batch`'s requests in process (no socket, no port).

A batch line's body goes to the very app `vlmrun serve` runs (`vlmrun.server.app.create_app`): the
same parsing and validation (400s), model check (404), admission, media policy (`ServerSettings`:
URL fetching, local paths), preprocessing pools, engine submission and response building, so a line
is answered exactly as the server would answer the request. Only the transport differs: the body is
handed to the ASGI app as one message, and the "client" never disconnects. The API key does not
apply (there is no client to authenticate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.server.app import create_app
from vlmrun.server.errors import internal
from vlmrun.server.settings import ServerSettings


@dataclasses.dataclass
class Answer:
    """The server's answer: HTTP status and JSON body."""

    status: int
    body: Any


class InProcessServer:
    """`post(path, body)` -> the `Answer` the server gives to `POST path` with that JSON body."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.app = create_app(engine, dataclasses.replace(settings, api_key=None))

    async def post(self, path: str, body: bytes) -> Answer:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode("ascii"), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))],
            "client": None, "server": None,
        }
        delivered = False
        status = 500
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # never set: a batch never leaves; the app cancels this wait when done
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        try:
            return Answer(status, json.loads(b"".join(chunks)))
        except ValueError:
            return Answer(500, internal(f"the server's answer (status {status}) is not JSON").body())

    def close(self) -> None:
        """Stop the app's preprocessing pools (the engine belongs to whoever built it)."""
        self.app.state.vlmrun.shutdown_pools()
