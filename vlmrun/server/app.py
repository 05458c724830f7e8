"""The FastAPI app: OpenAI-compatible routes in front of one `AsyncEngine`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/embeddings` (a server started
with `--runner pooling` answers only this one of the three, a generation server the other two: a 400
saying how to start the other kind), `GET /v1/models`,
`GET /v1/models/{model}`, `POST /tokenize`, `POST /detokenize` (`tokenize_handler.py`), `GET /health`,
`GET|POST /ping` (the same answer as /health), `GET /version` (`{"version": ...}`), `GET /metrics`.
With an API key set, the /v1 routes, /tokenize and /detokenize need `Authorization: Bearer <key>`
(health, ping, version and metrics stay open for probes and scrapers).
Every error, ours or the framework's (unknown route, wrong method), is answered in OpenAI's
JSON error shape; an unexpected exception becomes a JSON 500 that leaves the keep-alive connection
usable and is counted in /metrics like any other status. /v1/models shows the served name, never
the model's local path (that goes to the server log); with several served names (vLLM's
`--served-model-name a b`) it lists each. CORS as vLLM answers it (`ServerSettings.allowed_origins`
...: by default any origin). `root_path`: vLLM's --root-path, the prefix a proxy serves the app under
(the bare paths answer too). The app does not own the engine: whoever created the `AsyncEngine` starts
and stops it; the app's lifespan shuts down only its own preprocessing pool, and runs the periodic
statistics log line (`stats_log.py`, unless `log_stats` is off).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.pooling.runner_mode import WrongRunner
from vlmrun.server import chat_handler, completions_handler, embeddings_handler, tokenize_handler
from vlmrun.server.errors import APIError, bad_request, error_response, internal, unauthorized
from vlmrun.server.metrics import CONTENT_TYPE
from vlmrun.server.settings import ServerSettings
from vlmrun.server.state import ServerState
from vlmrun.server.stats_log import StatsLog
from vlmrun.server.transport import ClientDisconnected

logger = logging.getLogger(__name__)

_KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize",
                "/health",
                "/ping", "/version", "/metrics")


def create_app(engine: AsyncEngine, settings: ServerSettings, root_path: str = "") -> FastAPI:
    state = ServerState.build(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        vllm = state.metrics.vllm
        stats = (StatsLog(lambda: engine.stats, lambda: (vllm.prompt_total, engine.stats.generation_tokens),
                          settings.log_stats_interval_s).start() if settings.log_stats else None)
        idle_trims = asyncio.ensure_future(state.trimmer.trim_when_idle(lambda: state.admission.admitted,
                                                                        lambda: state.admission.in_flight))
        try:
            yield
        finally:
            idle_trims.cancel()
            if stats is not None:
                await stats.stop()
            state.shutdown_pools()

    app = FastAPI(title="vlmrun", version=vlmrun_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.root_path = root_path  # as vLLM sets it: requests with and without the prefix route alike
    app.state.vlmrun = state
    _install_error_handlers(app)
    app.add_middleware(_AnswerUnexpected)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)
    app.add_middleware(_CountResponses, state=state)  # added last: outermost, so it sees the 500s too
    logger.info("serving the model at %s as %r", engine.engine.model_config.path, state.model_name)

    def require_key(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise unauthorized()

    auth = [Depends(require_key)]

    def runner_is(pools: bool) -> Any:
        """400 (after the key check) for a generation route on a pooling server, or embeddings on a generation one."""
        def check(request: Request) -> None:
            try:
                engine.engine.pooling.check_call(pools)
            except WrongRunner as exc:
                raise bad_request(f"{request.url.path}: {exc}", code="wrong_runner") from None
        return Depends(check)

    generating, pooling = [*auth, runner_is(False)], [*auth, runner_is(True)]

    @app.post("/v1/chat/completions", dependencies=generating)
    async def chat_completions(request: Request) -> Response:
        return await chat_handler.chat_completions(state, request)

    @app.post("/v1/completions", dependencies=generating)
    async def completions(request: Request) -> Response:
        return await completions_handler.completions(state, request)

    @app.post("/v1/embeddings", dependencies=pooling)
    async def embeddings(request: Request) -> Response:
        return await embeddings_handler.embeddings(state, request)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        bases = [_model_card(state, name=name) for name in state.settings.served_model_names]
        return {"object": "list", "data": [*bases, *map(lambda n: _model_card(state, n), state.settings.lora_modules)]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def get_model(model: str) -> dict[str, Any]:
        state.check_model(model)
        if model in state.settings.served_model_names:
            return _model_card(state, name=model)
        return _model_card(state, model)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        return await tokenize_handler.tokenize(state, request)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        return await tokenize_handler.detokenize(state, request)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": vlmrun_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def vlmrun_version() -> str:
    """The installed vlmrun package's version."""
    return importlib.metadata.version("vlmrun")


def _model_card(state: ServerState, adapter: Optional[str] = None, name: Optional[str] = None) -> dict[str, Any]:
    """The served model's card under `name` (default: the reported one), or (`adapter`) a LoRA adapter's: its
    folder as root, the model as parent."""
    if adapter is not None:
        return {"id": adapter, "object": "model", "created": state.created, "owned_by": "vlmrun",
                "root": state.settings.lora_modules[adapter], "parent": state.model_name,
                "max_model_len": state.engine.max_model_len}
    name = name or state.model_name
    return {"id": name, "object": "model", "created": state.created, "owned_by": "vlmrun",
            "root": state.model_name, "parent": None,
            "max_model_len": state.engine.max_model_len}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, type=kind, headers=getattr(exc, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(APIError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return error_response(APIError(499, "the client closed the request", code="client_closed_request"))


class _AnswerUnexpected:
    """Pure ASGI middleware: an exception no handler answered becomes a JSON 500 here.

    Starlette's last-resort handler re-raises after answering, and uvicorn then drops the
    connection, so the client's next request on it would be reset. Here the exception ends: a
    500 if nothing was sent yet, else (a stream already under way) the body is closed.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = {"start": False, "end": False}

        async def watching_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if not sent["start"]:
                response = error_response(internal(f"internal server error: {type(exc).__name__}: {exc}"))
                await response(scope, receive, send)
            elif not sent["end"]:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _CountResponses:
    """Pure ASGI middleware (streaming-safe): counts responses by endpoint and status code."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root + "/"):  # behind --root-path
            path = path[len(root):]
        endpoint = next((p for p in _KNOWN_PATHS if path == p or path.startswith(p + "/")), "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
