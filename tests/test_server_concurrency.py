"""Many clients at once, some of them leaving half way.

32 concurrent streaming clients (the official async `openai` client), a quarter of which
disconnect after a few chunks of a long generation: every other request completes with all its
tokens, and afterwards the engine runs nothing and its KV pages (and GDN slots, once hybrid
models exist) and request rows are all free. A non-streaming client that times out is aborted
the same way.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server_fixtures import served_fixtures, tiny_engine, wait_until_idle
from tests.test_server import data_uri, image_part, picture, png_bytes
from vlmrun.server.launch import ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny"
NUM_CLIENTS = 32
GOOD_TOKENS = 12
LONG_TOKENS = 900  # what the leaving clients ask for: far more than the test waits for


engine, server = served_fixtures(served_model_name=MODEL)[:2]


def metric(server: ServerThread, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def one_client(client: openai.AsyncOpenAI, i: int, image_uri: str) -> dict:
    leaves = i % 4 == 3
    content: list = [{"type": "text", "text": f"Client {i}: tell me something."}]
    if i % 3 == 0:
        content.insert(0, image_part(image_uri))
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], stream=True, temperature=0.7, seed=i,
        max_tokens=LONG_TOKENS if leaves else GOOD_TOKENS, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks, finish, usage = 0, None, None
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
        if leaves and chunks == 4:
            await stream.close()  # hang up half way
            return {"left": True}
    return {"left": False, "finish": finish, "usage": usage}


def test_32_streaming_clients_some_leaving(server, engine):
    uri = data_uri(png_bytes(picture(64, 64, 5)))

    async def run_all() -> list[dict]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one_client(client, i, uri) for i in range(NUM_CLIENTS)))

    start, steps_before = time.monotonic(), engine.stats.num_steps
    results = asyncio.run(run_all())
    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == NUM_CLIENTS - NUM_CLIENTS // 4
    for r in stayed:
        assert r["finish"] == "length"
        assert r["usage"].completion_tokens == GOOD_TOKENS
    # the leavers' 900-token requests were aborted, not left running: the engine drains at once
    wait_until_idle(engine, timeout=10)
    assert time.monotonic() - start < 60
    print("steps", engine.stats.num_steps - steps_before)
    assert engine.stats.num_steps - steps_before < LONG_TOKENS // 2
    assert server.app.state.vlmrun.admission.in_flight == 0
    assert metric(server, "vlmrun_kv_cache_pages_used") == 0
    assert metric(server, "vlmrun_num_requests_running") == 0
    assert metric(server, "vlmrun_num_requests_waiting") == 0
    # and the server still answers
    out = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "still there?"}]})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_client_that_times_out_is_aborted(server, engine):
    body = {"model": MODEL, "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long one"}]}
    steps_before = engine.stats.num_steps
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    wait_until_idle(engine, timeout=10)
    print("steps", engine.stats.num_steps - steps_before)
    assert engine.stats.num_steps - steps_before < LONG_TOKENS
    assert server.app.state.vlmrun.admission.in_flight == 0


def test_stream_closed_during_prefill_is_aborted(server, engine):
    """A client that leaves before any token was sent is noticed without waiting for a write."""
    max_tokens = 200  # the 816-token prompt leaves room for 208 in the 1,024-token context
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "word " * 200}]}
    steps_before = engine.stats.num_steps
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk, then hang up
    wait_until_idle(engine, timeout=10)
    print("steps", engine.stats.num_steps - steps_before)
    assert engine.stats.num_steps - steps_before < max_tokens // 2
    assert server.app.state.vlmrun.admission.in_flight == 0


def test_hybrid_model_frees_its_gdn_slots(qwen3_5_dir):
    """With a hybrid (GDN) model, the GDN state pool is used while clients run and empty after."""
    engine = tiny_engine(qwen3_5_dir, max_model_len=512, max_num_seqs=16)
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL))
    peak = {"gdn": 0}
    try:
        async def client_run(client: openai.AsyncOpenAI, i: int) -> bool:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hybrid {i}"}], stream=True, seed=i,
                max_tokens=LONG_TOKENS // 3 if i % 2 else 8, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                peak["gdn"] = max(peak["gdn"], engine.stats.gdn_slots_used or 0)
                if i % 2 and n == 3:
                    await stream.close()
                    return False
            return True

        async def run_all() -> list[bool]:
            async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                return await asyncio.gather(*(client_run(client, i) for i in range(8)))

        done = asyncio.run(run_all())
        assert done == [i % 2 == 0 for i in range(8)]
        assert engine.stats.gdn_slots_total and peak["gdn"] > 0
        wait_until_idle(engine, timeout=10)
        assert engine.stats.gdn_slots_used == 0
        assert metric(srv, "vlmrun_gdn_pool_slots_used") == 0
    finally:
        srv.stop()
        engine.shutdown()
