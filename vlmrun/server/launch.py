"""Running the server: in the foreground (`vlmrun serve`) or in a background thread (`ServerThread`,
used by the tests and by `vlmrun web --model`).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.server.settings import ServerSettings


def build_engine(config: EngineConfig) -> AsyncEngine:
    """Load the model and start the engine thread."""
    return AsyncEngine(Engine(config)).start()


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

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
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
