"""Running the server: in the foreground (`vlmrun serve`) or in a background thread (`ServerThread`,
used by the tests and by `vlmrun web --model`).

The port is bound before the model loads (`bind_socket`: a busy port is an error at once, not after a
load of minutes) and handed to uvicorn afterwards (`run_server`); until then connections are refused.
`build_engine` says on stderr what it loads and how long it took (a ticking line on a terminal).
"""

from __future__ import annotations

import errno
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


def run_server(app: Any, sock: socket.socket, log_level: str = "info") -> None:
    """uvicorn serving `app` on the bound `sock` in the foreground, until Ctrl-C / SIGTERM."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


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
    _server: Any = None
    _thread: Optional[threading.Thread] = None
    _sock: Optional[socket.socket] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        import uvicorn

        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
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
                    port: int = 0) -> ServerThread:
    from vlmrun.server.app import create_app

    return ServerThread(create_app(engine, settings), host=host, port=port).start()
