"""Running the server: in the foreground (`vlmrun serve`) or in a background thread (`ServerThread`,
used by the tests and by `vlmrun web --model`).

The port is bound before the model loads (`bind_socket`: a busy port is an error at once, not after a
load of minutes) and handed to uvicorn afterwards (`run_server`); until then connections are refused.
`build_engine` says on stderr what it loads and how long it took (a ticking line on a terminal).
`HTTPOptions`: what uvicorn is told beside the app (vLLM's `--uvicorn-log-level`, `--root-path`,
`--ssl-*`, `--disable-uvicorn-access-log`).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.loading_line import loading_line
from vlmrun.server.settings import ServerSettings


class PortInUse(OSError):
    """The address the server was asked to listen on cannot be bound (in use, or not this host's)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port), not yet listening; PortInUse saying what to do
    when the port is taken or the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is already in use (another server?): stop it, or choose "
                            f"another with --port") from None
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@dataclass(frozen=True)
class HTTPOptions:
    """uvicorn's settings beside the app: log level, access log, the proxy's path prefix, TLS."""

    log_level: str = "info"
    access_log: bool = True
    root_path: str = ""
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"--{name.replace('_', '-')} {path}: no such file")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path {self.root_path!r} must start with '/', e.g. /llm")

    @classmethod
    def of(cls, args: argparse.Namespace) -> "HTTPOptions":
        return cls(log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
                   root_path=(args.root_path or "").rstrip("/"), ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                   ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def uvicorn_config(self, app: Any) -> Any:  # -> uvicorn.Config
        import uvicorn

        # the root path is the app's own (create_app), which serves both the prefixed and the bare paths
        return uvicorn.Config(app, log_level=self.log_level, access_log=self.access_log,
                              ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                              ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs,
                              lifespan="on", timeout_graceful_shutdown=5)


def run_server(app: Any, sock: socket.socket, http: HTTPOptions = HTTPOptions()) -> None:
    """uvicorn serving `app` on the bound `sock` in the foreground, until Ctrl-C / SIGTERM."""
    import uvicorn

    uvicorn.Server(http.uvicorn_config(app)).run(sockets=[sock])


def build_engine(config: EngineConfig, model: Optional[str] = None) -> AsyncEngine:
    """Load the model (`model`: its name for the progress line) and start the engine thread."""
    with loading_line(model or config.model or "the bundled default model"):
        engine = Engine(config)
    return AsyncEngine(engine).start()


@dataclass
class ServerThread:
    """uvicorn serving `app` on `host`:`port` (0 = a free port) in a daemon thread."""

    app: Any
    host: str = "127.0.0.1"
    port: int = 0
    log_level: str = "warning"
    http: Optional[HTTPOptions] = None  # None: plain HTTP at `log_level`
    _server: Any = None
    _thread: Optional[threading.Thread] = None
    _sock: Optional[socket.socket] = None

    @property
    def base_url(self) -> str:
        scheme = "http" if self.http is None else self.http.scheme
        return f"{scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        import uvicorn

        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._sock = sock
        http = self.http if self.http is not None else HTTPOptions(log_level=self.log_level)
        self._server = uvicorn.Server(http.uvicorn_config(self.app))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="vlmrun-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()


def serve_in_thread(engine: AsyncEngine, settings: ServerSettings, host: str = "127.0.0.1",
                    port: int = 0, http: Optional[HTTPOptions] = None) -> ServerThread:
    """`create_app` served by a `ServerThread`; `http`: uvicorn's settings (`vlmrun serve`'s HTTP flags)."""
    from vlmrun.server.app import create_app

    app = create_app(engine, settings, root_path="" if http is None else http.root_path)
    return ServerThread(app, host=host, port=port, http=http).start()
