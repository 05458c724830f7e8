"""The server's RSS comes back after hostile requests (issue 45, "RSS back within 10 %").

- A refused request leaves no reference cycle: its error, the task that raised it and the frame that
  awaited the task would otherwise keep the refused media (a video's decoder and bytes) until the
  cyclic collector's next full pass.
- A large block freed in a worker thread goes back to the kernel on `malloc_trim` once the process
  shares one malloc arena (`share_one_arena`), which `vlmrun serve` asks for before any thread starts;
  without it the block stays in the thread arena's top, which the CPU engine's trim threshold keeps.
- The server loads its video decoder at start, not on a client's first video.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from vlmrun.server.transport import until_done_or_disconnected

ROOT = Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class _StaysConnected:
    """A request whose client never leaves (the ASGI receive never answers)."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


class _Held:
    """Stands for what a refused preparation holds in its frame (a video decoder, its bytes)."""


def test_a_refused_request_leaves_no_reference_cycle() -> None:
    refs: list[weakref.ref] = []

    async def refused_work() -> None:
        held = _Held()
        refs.append(weakref.ref(held))
        raise ValueError("refused")

    async def handler() -> str:
        try:
            await until_done_or_disconnected(_StaysConnected(), refused_work())
        except ValueError as exc:
            return str(exc)
        return "not refused"

    gc.collect()
    gc.disable()  # freed by reference counts alone, or not at all
    try:
        assert asyncio.run(handler()) == "refused"
        assert refs[0]() is None, "the refused work's frame is kept alive by a reference cycle"
    finally:
        gc.enable()


_ARENA_PROBE = """
import ctypes, sys, threading
from vlmrun.executor.cpu_malloc import keep_freed_memory
from vlmrun.server.memory import share_one_arena

if sys.argv[1] == "shared":
    assert share_one_arena()
assert keep_freed_memory()  # as the CPU engine does: freed memory kept up to a 2 GiB trim threshold

def rss():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS:"))

def parse_a_large_body():  # a worker thread: a 50 MB body and its parsed string, then freed
    body = b"x" * (50 << 20)
    text = body.decode()
    del body, text

before = rss()
worker = threading.Thread(target=parse_a_large_body)
worker.start()
worker.join()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print((rss() - before) >> 20)
"""


def _kept_mb(mode: str) -> int:
    chosen = ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _ARENA_PROBE, mode], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc arenas")
def test_a_large_block_freed_in_a_worker_thread_goes_back_with_one_arena() -> None:
    assert _kept_mb("own-arena") >= 40  # the case: a thread arena's free top stays resident after malloc_trim
    assert _kept_mb("shared") < 10


def test_serve_shares_one_arena_before_loading_anything(monkeypatch) -> None:
    from vlmrun.server import cli, memory

    calls: list[str] = []
    monkeypatch.setattr(memory, "share_one_arena", lambda: calls.append("arena") or True)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    with socket.socket() as busy:  # a busy port: serve stops before loading the model
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        args = parser.parse_args(["serve", "--port", str(busy.getsockname()[1])])
        assert cli.serve(args) == 2
    assert calls == ["arena"]


def test_the_server_loads_its_video_decoder_at_start(qwen3_vl_dir) -> None:
    from tests.test_server import tiny_engine
    from vlmrun.server.app import create_app
    from vlmrun.server.settings import ServerSettings
    from vlmrun.processors.video_io import video_decoder

    engine = tiny_engine(qwen3_vl_dir, max_model_len=128)
    try:
        assert engine.engine.processor.video_processor is not None
        video_decoder.cache_clear()
        create_app(engine, ServerSettings(served_model_name="tiny"))
        assert video_decoder.cache_info().currsize == 1
    finally:
        engine.shutdown()


def test_the_memory_of_a_busy_spell_is_handed_back_once_idle(qwen3_vl_dir) -> None:
    import time

    import httpx

    from tests.test_server import tiny_engine
    from vlmrun.server.launch import serve_in_thread
    from vlmrun.server.settings import ServerSettings

    engine = tiny_engine(qwen3_vl_dir, max_model_len=128)
    srv = serve_in_thread(engine, ServerSettings(served_model_name="tiny"))
    try:
        trimmer = srv.app.state.vlmrun.trimmer
        if trimmer._libc is None:
            pytest.skip("glibc only")
        trimmer.idle_s = 0.4
        time.sleep(1.5)
        assert trimmer.trims == 0  # nothing served: nothing to hand back
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while trimmer.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert trimmer.trims == 1
        time.sleep(1.5)
        assert trimmer.trims == 1  # once per busy spell, not while idle
    finally:
        srv.stop()
        engine.shutdown()


def test_media_that_raised_the_rss_are_followed_by_a_trim(qwen3_vl_dir, monkeypatch) -> None:
    import io
    import time

    import httpx
    from PIL import Image

    from tests.test_server import data_uri, tiny_engine
    from vlmrun.server import memory
    from vlmrun.server.launch import serve_in_thread
    from vlmrun.server.settings import ServerSettings

    engine = tiny_engine(qwen3_vl_dir, max_model_len=256)
    srv = serve_in_thread(engine, ServerSettings(served_model_name="tiny"))
    try:
        trimmer = srv.app.state.vlmrun.trimmer
        if trimmer._libc is None:
            pytest.skip("glibc only")
        trimmer.idle_s = 3600.0  # only the media rule here
        rss = [100 << 20]
        monkeypatch.setattr(memory, "rss_bytes", lambda: rss[0])
        trimmer._floor = 100 << 20
        buf = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(buf.getvalue(), "image/png")}},
            {"type": "text", "text": "What is it?"}]}]}
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            rss[0] = trimmer._floor + trimmer.media_growth_bytes  # grown, not past the threshold
            assert http.post("/v1/chat/completions", json=body).status_code == 200
            time.sleep(trimmer.delay_s + 0.5)
            assert trimmer.trims == 0
            rss[0] = trimmer._floor + trimmer.media_growth_bytes + 1  # as after images of tens of megapixels
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while trimmer.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert trimmer.trims == 1
    finally:
        srv.stop()
        engine.shutdown()
