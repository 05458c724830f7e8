"""Bad requests get the right 4xx in OpenAI's error shape, and the server keeps serving.

Each case is followed by a good request, which must succeed: a bad request never poisons the
engine or leaks its memory.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Iterator

import httpx
import openai
import pytest
from PIL import Image

from tests.test_server import data_uri, image_part, picture, png_bytes, tiny_engine, wait_until_idle
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.server.launch import ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny"
BODY_LIMIT = 2 << 20


@pytest.fixture(scope="module")
def engine(qwen3_vl_dir) -> Iterator[AsyncEngine]:
    eng = tiny_engine(qwen3_vl_dir, max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ServerThread]:
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, max_request_bytes=BODY_LIMIT))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)


def post(server: ServerThread, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    if not isinstance(body, (dict, list)):  # raw bytes / text / an iterator of chunks
        return httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(server.base_url + path, json=body, timeout=30, **kw)


def user(content) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in err["message"].lower(), (word, err["message"])
    return err


def assert_serves(server: ServerThread) -> None:
    r = post(server, user([image_part(data_uri(png_bytes(picture(40, 30, 0)))), {"type": "text", "text": "ok?"}]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def bomb_png() -> bytes:
    """A 3000x2000 PNG (6 MP > the 4 MP limit) that compresses to a few KB."""
    buf = io.BytesIO()
    Image.new("RGB", (3000, 2000), (10, 20, 30)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


CASES = {
    "malformed_json": (b'{"model": "tiny", "messages": [', 400, ("json",)),
    "not_an_object": (b"[1, 2, 3]", 400, ("object",)),
    "empty_body": (b"", 400, ("empty",)),
    "no_messages": ({"model": MODEL}, 400, ("messages",)),
    "bad_base64": (user([image_part("data:image/png;base64,@@@not-base64@@@"), "x"]), 400, ("base64",)),
    "not_an_image": (user([image_part(data_uri(b"hello, I am plain text and no picture at all"))]), 400,
                     ("not a recognised image",)),
    "html_media_type": (user([image_part("data:text/html;base64," + base64.b64encode(b"<html>").decode())]), 400,
                        ("not an image type",)),
    "decompression_bomb": (user([image_part(data_uri(bomb_png()))]), 400, ("pixels",)),
    "prompt_too_long": (user("word " * 400), 400, ("tokens",)),
    "negative_max_tokens": ({**user("hi"), "max_tokens": -5}, 400, ("max_tokens",)),
    "zero_max_completion_tokens": ({**user("hi"), "max_completion_tokens": 0}, 400, ("max_completion_tokens",)),
    "temperature_string": ({**user("hi"), "temperature": "hot"}, 400, ("temperature",)),
    "top_p_too_big": ({**user("hi"), "top_p": 1.5}, 400, ("top_p",)),
    "n_too_big": ({**user("hi"), "n": 1000}, 400, ("'n'",)),
    "top_logprobs_without_logprobs": ({**user("hi"), "top_logprobs": 2}, 400, ("logprobs",)),
    "bad_role": (user("hi") | {"messages": [{"content": "no role"}]}, 400, ("role",)),
    "video": (user([{"type": "video_url", "video_url": {"url": "x"}}]), 400, ("not supported",)),
    "tools": ({**user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, ("tool",)),
    "private_url": (user([image_part("http://127.0.0.1:9/cat.png"), "x"]), 400, ("loopback",)),
    "private_url_10": (user([image_part("http://10.1.2.3/cat.png"), "x"]), 400, ("private",)),
    "metadata_url": (user([image_part("http://169.254.169.254/latest/meta-data"), "x"]), 400, ("link-local",)),
    "localhost_url": (user([image_part("http://localhost:9/cat.png"), "x"]), 400, ("loopback",)),
    "ftp_url": (user([image_part("ftp://example.com/cat.png"), "x"]), 400, ("scheme",)),
    "local_path": (user([image_part("/etc/passwd"), "x"]), 400, ("local image paths are not accepted",)),
    "file_uri": (user([image_part("file:///etc/hostname"), "x"]), 400, ("local image paths are not accepted",)),
    "unknown_model": ({**user("hi"), "model": "gpt-unknown"}, 404, ("gpt-unknown",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_then_good_request(server, name):
    body, status, words = CASES[name]
    err = assert_error(post(server, body), status, *words)
    if status == 404:
        assert err["code"] == "model_not_found"
    assert_serves(server)


def test_bad_streaming_request_fails_before_the_stream(server):
    r = post(server, {**user("word " * 400), "stream": True})
    assert_error(r, 400, "tokens")
    assert r.headers["content-type"].startswith("application/json")


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert "max_tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            image_part("data:image/png;base64,Zm9v!!"), {"type": "text", "text": "x"}]}])
    assert "base64" in info.value.message


def test_oversized_body_is_413(server):
    big = json.dumps(user([image_part("data:image/png;base64," + "A" * (BODY_LIMIT + 10)), "x"])).encode()
    assert_error(post(server, big), 413, "larger than")

    def chunked():  # no Content-Length: the cap applies while reading
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    assert_error(post(server, chunked()), 413, "larger than")
    assert_serves(server)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.base_url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.base_url + "/v1/chat/completions"), 405)
    assert_error(httpx.get(server.base_url + "/v1/models/other-model"), 404, "other-model")


def test_completions_errors(server):
    assert_error(post(server, {"model": MODEL, "prompt": ""}, "/v1/completions"), 400, "prompt")
    assert_error(post(server, {"model": MODEL, "prompt": "a <|image_pad|> b"}, "/v1/completions"), 400, "reserved")
    assert_error(post(server, {"model": MODEL, "prompt": [1, 2, 10 ** 7]}, "/v1/completions"), 400, "vocabulary")
    assert_error(post(server, {"model": MODEL, "prompt": "x", "suffix": "y"}, "/v1/completions"), 400, "suffix")
    ok = post(server, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}, "/v1/completions")
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3


def test_queue_full_is_429(server, engine):
    admission = server.app.state.vlmrun.admission
    limit = admission.limit
    admission.limit = 1
    try:
        r = post(server, {**user("hi"), "n": 2})
        err = assert_error(r, 429, "queue is full")
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
    finally:
        admission.limit = limit
    assert_serves(server)
    wait_until_idle(engine)
    assert admission.in_flight == 0


def test_engine_not_running_is_503(engine):
    stopped = AsyncEngine(engine.engine)  # never started: it must refuse, never touch the engine
    srv = serve_in_thread(stopped, ServerSettings(served_model_name=MODEL))
    try:
        assert httpx.get(srv.base_url + "/health").status_code == 503
        assert_error(post(srv, user("hi")), 503, "not running")
    finally:
        srv.stop()
