"""The tiny engine and live server that the server tests share, and one factory for their fixtures.

A test module that serves the tiny checkpoint writes one line:

    engine, server, client = served_fixtures(max_model_len=256, settings={"max_request_bytes": LIMIT})

and gets three module-scoped fixtures under those names: `engine` (an `AsyncEngine` over the checkpoint
fixture named by `checkpoint`, built by `tiny_engine` with the keyword overrides), `server` (a uvicorn
thread serving `engine` (as `MODEL` unless told), with `ServerSettings` from `settings`) and `client` (the official
`openai` client on it). A module that needs only some takes those (`engine, server = served_fixtures(...)[:2]`);
one that builds its engine otherwise (tensor parallel from the CLI's flags) defines `engine` itself and
still takes `server` and `client`, which ask for `engine` by name. Each fixture is module-scoped, so a
module starts one engine and one server, as when each file wrote its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import openai
import pytest

from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.server.launch import ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny-qwen3-vl"  # the served model name

# What a fixture reads from the test's request: a checkpoint folder, the server's settings.
Checkpoint = Union[str, Callable[[pytest.FixtureRequest], Path]]  # a session fixture's name, or a function
Settings = Union[dict[str, Any], Callable[[pytest.FixtureRequest], dict[str, Any]]]


def tiny_engine(model_dir, **overrides) -> AsyncEngine:
    """The tiny checkpoint behind an AsyncEngine with small pools (fast to build on CPU)."""
    options = dict(model=str(model_dir), dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=64,
                   kv_cache_memory_bytes=32 << 20, max_image_pixels=4_000_000)
    options.update(overrides)
    return AsyncEngine(Engine(EngineConfig(**options))).start()


def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Wait until the engine runs nothing and its KV pages and request rows are all free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_pages_used == 0 and s.req_rows_used == 0 \
                and s.num_groups == 0 and not s.gdn_slots_used:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not drain: {engine.stats}")


def served_fixtures(checkpoint: Checkpoint = "qwen3_vl_dir", *, settings: Optional[Settings] = None,
                    served_model_name: str = MODEL, api_key: str = "unused", timeout: float = 60,
                    **engine_options: Any) -> tuple[Any, Any, Any]:
    """Module-scoped fixtures `engine`, `server` and `client` (in that order), to assign to those names.

    `checkpoint`: the session fixture holding the model folder ("qwen3_vl_dir", "qwen3_dir"), or a
    function of the request that returns one; `engine_options`: `tiny_engine`'s overrides of
    `EngineConfig`; `settings`: `ServerSettings` fields beside `served_model_name` (or a function of the
    request that returns them); `served_model_name`: the model's name on the server; `api_key` /
    `timeout`: the client's.
    """

    @pytest.fixture(scope="module", name="engine")
    def engine_fixture(request: pytest.FixtureRequest) -> Iterator[AsyncEngine]:
        model_dir = request.getfixturevalue(checkpoint) if isinstance(checkpoint, str) else checkpoint(request)
        engine = tiny_engine(model_dir, **engine_options)
        yield engine
        engine.shutdown()

    @pytest.fixture(scope="module", name="server")
    def server_fixture(request: pytest.FixtureRequest, engine: AsyncEngine) -> Iterator[ServerThread]:
        fields = settings(request) if callable(settings) else dict(settings or {})
        server = serve_in_thread(engine, ServerSettings(served_model_name=served_model_name, **fields))
        yield server
        server.stop()

    @pytest.fixture(scope="module", name="client")
    def client_fixture(server: ServerThread) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    return engine_fixture, server_fixture, client_fixture
