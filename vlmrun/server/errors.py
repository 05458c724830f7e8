"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

`APIError` carries the HTTP status; `error_response` renders any of them. The constructors name
the cases the server distinguishes (bad input 400, missing key 401, unknown model 404, body too
large 413, queue full 429, engine not running 503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fastapi.responses import JSONResponse

from vlmrun.processors.limits import quote


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None
    headers: Optional[dict[str, str]] = None

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(404, f"the model {quote(model)} does not exist on this server; it serves {', '.join(map(repr, served))}",
                    param="model", code="model_not_found", type="not_found_error")


def not_json(content_type: str) -> APIError:
    """415 for a body that does not say it is JSON: a browser page may POST text/plain (or form, or
    untyped) bodies to any address without asking first, JSON bodies only with the server's consent."""
    what = f"Content-Type {quote(content_type)}" if content_type else "no Content-Type"
    return APIError(415, f"the request body must be JSON (Content-Type: application/json); got {what}",
                    code="unsupported_media_type")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit:,} bytes",
                    code="request_too_large")


def queue_full(limit: int) -> APIError:
    return APIError(429, f"the server's request queue is full ({limit} requests in flight); retry shortly",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", type="server_error", code="engine_unavailable",
                    headers={"Retry-After": "5"})


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
