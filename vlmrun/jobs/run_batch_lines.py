"""The lines of `vlmrun run-batch`: OpenAI's (and vLLM's) batch format, in and out.

Input, one request per line (blank lines are skipped):

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per input line, in input order:

    {"id": "vlmrun-…", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "vlmrun-batch-…", "body": {...the server's answer...}},
     "error": null}

A failed line is vLLM's: `"response": null` and `error` the server's error answer, the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`:

    {"id": "vlmrun-…", "custom_id": "req-2", "response": null,
     "error": {"error": {"message": "...", "type": "invalid_request_error", "param": "messages", "code": null}}}

That is a request the server answers with an error (400, 404, 413, …), and a line that is not a request
the job can send (bad JSON, no `custom_id`, an unknown `url`, a `custom_id` seen before in the input,
`"stream": true`).

Each output line is recorded under a key, which a rerun skips: its `custom_id`, or, for a line
refused for having no usable `custom_id` of its own (bad JSON, none given, a repeat), its line
number, which its `id` then names (`vlmrun-line-N`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from vlmrun.jobs.journal import RecordFormat
from vlmrun.server.errors import APIError, bad_request

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # on an engine started with --runner pooling
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
LINE_ID_PREFIX = "vlmrun-line-"


@dataclass
class BatchRequest:
    """One request line to send: `body` is the request's JSON object."""

    line: int  # 1-based line number in the input
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class Refusal:
    """A line the job does not send, and why. `custom_id`: the line's, when it has one; `keyed_by_line`:
    it is recorded under its line number (its custom_id is missing or not its own)."""

    line: int
    custom_id: Optional[str]
    error: APIError
    keyed_by_line: bool


def custom_id_key(custom_id: str) -> str:
    """The key of a line recorded by its custom_id."""
    return f"custom_id {custom_id}"


def line_key(line: int) -> str:
    """The key of a line recorded by its number (never equal to a custom_id's key)."""
    return f"line {line}"


def read_line(raw: bytes, line: int) -> Union[BatchRequest, Refusal]:
    """The request on input line number `line`, or why it cannot be sent."""
    try:
        value = json.loads(raw)
    except ValueError as exc:  # not JSON, or not UTF-8
        return Refusal(line, None, bad_request(f"line {line} is not valid JSON: {exc}"), keyed_by_line=True)
    if not isinstance(value, dict):
        return Refusal(line, None, bad_request(f"line {line} is not a JSON object"), keyed_by_line=True)
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str):
        return Refusal(line, None, bad_request(f"line {line} has no custom_id (a string)", param="custom_id"),
                       keyed_by_line=True)
    url, method, body = value.get("url"), value.get("method"), value.get("body")
    if url not in URLS:
        why = f"url {url!r} is not supported; supported endpoints: {', '.join(URLS)}"
        return Refusal(line, custom_id, bad_request(why, param="url"), keyed_by_line=False)
    if method != "POST":
        return Refusal(line, custom_id, bad_request(f"method {method!r} is not supported; only POST", param="method"),
                       keyed_by_line=False)
    if not isinstance(body, dict):
        return Refusal(line, custom_id, bad_request("body must be a JSON object", param="body"), keyed_by_line=False)
    if body.get("stream") is True:
        return Refusal(line, custom_id, bad_request("a batch request must not be sent in stream mode", param="stream"),
                       keyed_by_line=False)
    return BatchRequest(line, custom_id, url, body)


def item_key(item: Union[BatchRequest, Refusal]) -> str:
    """The key the output line of `item` is recorded under."""
    if isinstance(item, Refusal) and (item.keyed_by_line or item.custom_id is None):
        return line_key(item.line)
    return custom_id_key(item.custom_id)


@dataclass
class BatchOutputLine:
    """One output line (fields in the order they are written)."""

    id: str
    custom_id: Optional[str]
    response: Optional[dict[str, Any]]  # None on a failed line
    error: Optional[dict[str, Any]]  # {"error": {...}} on a failed line

    @classmethod
    def answer(cls, custom_id: str, status: int, body: Any) -> "BatchOutputLine":
        """The server's answer to a request: `body` its JSON (an error body unless status is 200)."""
        line_id = f"vlmrun-{uuid.uuid4().hex}"
        if status == 200:
            return cls(line_id, custom_id, _response(status, body), None)
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            body = {"error": {"message": f"status {status}: {body}", "type": "server_error", "param": None,
                              "code": None}}
        return cls(line_id, custom_id, None, body)

    @classmethod
    def refusal(cls, refused: Refusal) -> "BatchOutputLine":
        err = refused.error
        line_id = f"{LINE_ID_PREFIX}{refused.line}" if refused.keyed_by_line else f"vlmrun-{uuid.uuid4().hex}"
        return cls(line_id, refused.custom_id, None, err.body())

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_tokens(self) -> int:
        """Completion tokens of a successful answer (its `usage`), 0 otherwise."""
        body = self.response["body"] if self.response is not None else None
        usage = body.get("usage") if isinstance(body, dict) else None
        return int(usage.get("completion_tokens") or 0) if isinstance(usage, dict) and not self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "custom_id": self.custom_id, "response": self.response, "error": self.error}


def _response(status: int, body: Any) -> dict[str, Any]:
    return {"status_code": status, "request_id": f"vlmrun-batch-{uuid.uuid4().hex}", "body": body}


def _numbered_line(line_id: str) -> Optional[int]:
    """N of an id `vlmrun-line-N`, else None."""
    number = line_id[len(LINE_ID_PREFIX):] if line_id.startswith(LINE_ID_PREFIX) else ""
    return int(number) if number.isdigit() else None


def _is_output_line(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("id"), str)
            and all(k in value for k in ("custom_id", "response", "error"))
            and (isinstance(value["custom_id"], str) or _numbered_line(value["id"]) is not None))


def output_key(record: dict[str, Any]) -> str:
    """The key a written output line was recorded under (see the module docstring)."""
    number = _numbered_line(record["id"])
    return line_key(number) if number is not None else custom_id_key(record["custom_id"])


BATCH_LINES = RecordFormat(start=b'{"id":', is_record=_is_output_line, key=output_key, what="run-batch")
