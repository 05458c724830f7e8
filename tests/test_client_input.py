"""Client input never yields a 5xx, and a per-request error stays per request (issue 29).

Against the server: JSON routes take only JSON bodies (415 otherwise: a web page may POST text/plain,
form or untyped bodies cross-site without asking); lone surrogates are a 400; a request that could
never be admitted is a 400, not a 429 to retry forever; prompt + max_tokens beyond the context is a
400 as in vLLM; a client that leaves mid-upload is a 499, not a 500; error messages quote at most a
bounded prefix of client strings; a non-ASCII API key is refused at start-up. Against `LLM`: a lone
surrogate fails that prompt alone.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Iterator

import httpx
import pytest

from tests.server_fixtures import served_fixtures
from tests.test_server_hardening import status_counts
from vlmrun import LLM, SamplingParams
from vlmrun.server.settings import ServerSettings

MODEL = "tiny"
CONTEXT = 128


engine, server = served_fixtures(max_model_len=CONTEXT, max_num_seqs=8, served_model_name=MODEL,
                                 settings={"max_queued_requests": 8, "max_n": 16})[:2]


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def chat_body(content: str = "Say something.", **extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **extra}


def no_5xx(http: httpx.Client) -> None:
    assert not [s for s in status_counts(http) if s.startswith("5")], status_counts(http)


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_json_routes_refuse_other_bodies(http, content_type, path):
    body = chat_body() if "chat" in path else {"model": MODEL, "max_tokens": 2, "prompt": "Hi"}
    headers = {"Content-Type": content_type} if content_type else {}
    request = http.build_request("POST", path, content=json.dumps(body).encode(), headers=headers)
    if content_type is None:
        request.headers.pop("Content-Type", None)
    r = http.send(request)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    for ok in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        assert http.post(path, content=json.dumps(body), headers={"Content-Type": ok}).status_code == 200, ok
    no_5xx(http)


@pytest.mark.parametrize("where", ["chat", "chat part", "completion", "system"])
def test_lone_surrogates_are_a_400(http, where):
    text = "a \ud800 b" if where != "system" else "x \udfff"
    if where == "chat":
        body, path = chat_body(text), "/v1/chat/completions"
    elif where == "chat part":
        body, path = chat_body() | {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}, \
            "/v1/chat/completions"
    elif where == "system":
        body, path = chat_body() | {"messages": [{"role": "system", "content": text},
                                                 {"role": "user", "content": "Hi"}]}, "/v1/chat/completions"
    else:
        body, path = {"model": MODEL, "max_tokens": 2, "prompt": ["fine", text]}, "/v1/completions"
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\ud800 escape, as a client sends it
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"]
    no_5xx(http)


def test_a_request_that_can_never_be_admitted_is_a_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "n": 16, "prompt": ["x"] * 100})
    assert r.status_code == 400, r.text
    assert "Retry-After" not in r.headers and "1,600" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "n": 2, "prompt": ["x"] * 3})
    assert r.status_code == 200, r.text


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(http):
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=CONTEXT))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"maximum context length is {CONTEXT}" in error["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT + 5})
    assert r.status_code == 400, r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi", "word " * 20], "max_tokens": 60})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text  # the second
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=8)).status_code == 200


def test_error_messages_quote_a_bounded_prefix(http):
    r = http.post("/v1/chat/completions", json=chat_body(model="m" * 1_000_000))
    assert r.status_code == 404
    assert len(r.text) < 1_000 and "1,000,000 characters" in r.text


def test_a_client_leaving_mid_upload_is_not_a_server_error(server, http):
    before = status_counts(http)
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"model": "tiny", "messages": [' + b" " * 1000)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and status_counts(http) == before:
        time.sleep(0.1)
    after = status_counts(http)
    assert after.get("499", 0) == before.get("499", 0) + 1, (before, after)
    no_5xx(http)
    assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


@pytest.mark.parametrize("key", ["clé", "key with\nnewline", " padded ", ""])
def test_an_api_key_no_client_could_send_is_refused_at_start(key):
    with pytest.raises(ValueError, match="api_key must be printable ASCII"):
        ServerSettings(served_model_name=MODEL, api_key=key)


def test_serve_refuses_a_non_ascii_api_key_before_loading_a_model():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "vlmrun.cli", "serve", "--api-key", "clé", "--model", "/nonexistent"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "vlmrun serve: ServerSettings.api_key must be printable ASCII" in run.stderr


def test_llm_surrogate_fails_that_prompt_alone(qwen3_vl_dir):
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_model_len=CONTEXT)
    outs = llm.generate(["fine", "bad \ud800", {"prompt": "also \udc00 bad"}], SamplingParams(max_tokens=2),
                        use_tqdm=False)
    assert outs[0].error is None and outs[0].token_ids
    assert all("lone surrogate" in o.error for o in outs[1:])
    chat = llm.chat([[{"role": "user", "content": "x\ud83d"}], [{"role": "user", "content": "ok"}]],
                    SamplingParams(max_tokens=2), use_tqdm=False)
    assert "lone surrogate" in chat[0].error and chat[1].error is None
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_error_messages_quote_a_bounded_prefix_of_any_client_string(http):
    huge = "x" * 200_000
    bodies = [chat_body() | {"messages": [{"role": "user", "content": [{"type": huge}]}]},
              chat_body() | {"messages": [{"role": huge, "content": "hi"}]},
              chat_body() | {"messages": [{"role": "user", "content": [
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "max_pixels": huge}]}]}]
    for body in bodies:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and len(r.text) < 2_000, r.text[:300]
