"""Bad requests get the right 4xx in OpenAI's error shape, and the server keeps serving.

Each case is followed by a good request on the same keep-alive connection, which must answer
exactly as before (greedy): a bad request never poisons the engine, leaks its memory or costs the
client its connection. Where the field is known, the error's `param` names it.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from tests.server_fixtures import served_fixtures, wait_until_idle
from tests.test_server import data_uri, image_part, picture, png_bytes
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.server.launch import ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny"
BODY_LIMIT = 2 << 20


engine, server, client = served_fixtures(max_model_len=256, settings={"max_request_bytes": BODY_LIMIT},
                                         served_model_name=MODEL, api_key="x", timeout=30)


def post(server: ServerThread, body, path: str = "/v1/chat/completions", http: httpx.Client | None = None,
         **kw) -> httpx.Response:
    """POST `body` (a dict / list as JSON, else raw bytes / text / an iterator of chunks), on `http`'s
    connection when given."""
    send = http.post if http is not None else httpx.post
    if not isinstance(body, (dict, list)):
        return send(server.base_url + path, content=body, headers={"content-type": "application/json"},
                    timeout=30, **kw)
    return send(server.base_url + path, json=body, timeout=30, **kw)


def user(content) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in err["message"].lower(), (word, err["message"])
    return err


GOOD_REQUEST = {**user([image_part(data_uri(png_bytes(picture(40, 30, 0)))), {"type": "text", "text": "ok?"}]),
                "temperature": 0}


def assert_serves(server: ServerThread, http: httpx.Client | None = None) -> dict:
    """The good request succeeds (on `http`'s connection when given); returns its message."""
    r = post(server, GOOD_REQUEST, http=http)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    return r.json()["choices"][0]["message"]


def nested(depth: int) -> bytes:
    """A chat body carrying an extra field of `depth` nested arrays (the body itself nests 1 deeper)."""
    return (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "x": '
            + b"[" * depth + b"]" * depth + b"}")


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
    "video": (user([{"type": "video_url", "video_url": {"url": "x"}}]), 400, ("video 1", "local")),
    "audio": (user([{"type": "input_audio", "input_audio": {"data": "x"}}]), 400, ("not supported",)),
    "tools": ({**user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, ("tool",)),
    "bad_json_schema": ({**user("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, ("does not compile",)),
    "bad_guided_regex": ({**user("hi"), "guided_regex": "(unclosed"}, 400, ("does not compile",)),
    "two_constraints": ({**user("hi"), "guided_regex": "a", "guided_choice": ["a"]}, 400, ("at most one",)),
    "private_url": (user([image_part("http://127.0.0.1:9/cat.png"), "x"]), 400, ("loopback",)),
    "private_url_10": (user([image_part("http://10.1.2.3/cat.png"), "x"]), 400, ("private",)),
    "metadata_url": (user([image_part("http://169.254.169.254/latest/meta-data"), "x"]), 400, ("link-local",)),
    "localhost_url": (user([image_part("http://localhost:9/cat.png"), "x"]), 400, ("loopback",)),
    "ftp_url": (user([image_part("ftp://example.com/cat.png"), "x"]), 400, ("scheme",)),
    "local_path": (user([image_part("/etc/passwd"), "x"]), 400, ("local image paths are not accepted",)),
    "file_uri": (user([image_part("file:///etc/hostname"), "x"]), 400, ("local image paths are not accepted",)),
    "unknown_model": ({**user("hi"), "model": "gpt-unknown"}, 404, ("gpt-unknown",)),
    # hostile bodies (issue 20): each was a 500, a stall or silently accepted
    "nested_1000_deep": (nested(1000), 400, ("levels deep",)),
    "nested_100k_deep": (nested(100_000), 400, ("levels deep",)),
    "nested_past_the_limit": (nested(65), 400, ("levels deep",)),
    "infinity_literal": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400,
                         ("Infinity",)),
    "nan_literal": (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400, ("NaN",)),
    "integer_of_5000_digits": (b'{"messages": [{"role": "user", "content": "hi"}], "n": 1' + b"0" * 5000 + b"}",
                               400, ("json",)),
    "temperature_1e308": ({**user("hi"), "temperature": 1e308}, 400, ("temperature",), "temperature"),
    "temperature_above_2": ({**user("hi"), "temperature": 2.5}, 400, ("temperature",), "temperature"),
    "seed_above_64_bits": ({**user("hi"), "seed": 2**64}, 400, ("seed",), "seed"),
    "seed_below_64_bits": ({**user("hi"), "seed": -(2**63) - 1}, 400, ("seed",), "seed"),
    "seed_above_64_bits_streamed": ({**user("hi"), "seed": 2**64, "stream": True}, 400, ("seed",), "seed"),
    "top_p_string": ({**user("hi"), "top_p": "x"}, 400, ("top_p",), "top_p"),
    "repetition_penalty_string": ({**user("hi"), "repetition_penalty": "x"}, 400, ("repetition_penalty",),
                                  "repetition_penalty"),
    "stop_number": ({**user("hi"), "stop": 5}, 400, ("stop",), "stop"),
    "stop_token_ids_number": ({**user("hi"), "stop_token_ids": 5}, 400, ("stop_token_ids",), "stop_token_ids"),
    "stop_token_ids_strings": ({**user("hi"), "stop_token_ids": ["a"]}, 400, ("stop_token_ids",), "stop_token_ids"),
    "stop_token_ids_fraction": ({**user("hi"), "stop_token_ids": [1.7]}, 400, ("stop_token_ids",),
                                "stop_token_ids"),
    "stop_token_id_above_64_bits": ({**user("hi"), "stop_token_ids": [2**64]}, 400, ("stop_token_ids",),
                                    "stop_token_ids"),
    "ignore_eos_string": ({**user("hi"), "ignore_eos": "no"}, 400, ("ignore_eos",), "ignore_eos"),
    "n_true": ({**user("hi"), "n": True}, 400, ("'n'",), "n"),
    "max_tokens_true": ({**user("hi"), "max_tokens": True}, 400, ("max_tokens",), "max_tokens"),
    "top_logprobs_million": ({**user("hi"), "logprobs": True, "top_logprobs": 10**6}, 400, ("top_logprobs",),
                             "top_logprobs"),
    "too_many_stop_strings": ({**user("hi"), "stop": [f"s{i}" for i in range(33)]}, 400, ("at most 32",), "stop"),
    "hundred_thousand_stop_strings": ({**user("hi"), "stop": [f"{i:013d}" for i in range(100_000)]}, 400,
                                      ("at most 32",), "stop"),
    "stop_string_too_long": ({**user("hi"), "stop": ["x" * 513]}, 400, ("at most 512",), "stop"),
    "too_many_stop_token_ids": ({**user("hi"), "stop_token_ids": list(range(65))}, 400, ("at most 64",),
                                "stop_token_ids"),
    "unknown_role": (user("hi") | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ("unknown role",),
                     "messages"),
    "tool_without_tool_call": (user("hi") | {"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
                               400, ("tool call",), "messages"),
    "tool_call_id_a_list": (user("hi") | {"messages": [{"role": "tool", "content": "42", "tool_call_id": []}]},
                            400, ("tool call",), "messages"),
    "content_null": (user("hi") | {"messages": [{"role": "user", "content": None}]}, 400, ("no content",),
                     "messages"),
    "content_missing": (user("hi") | {"messages": [{"role": "user"}]}, 400, ("no content",), "messages"),
    "assistant_content_null_without_tool_calls": (
        user("hi") | {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                   {"role": "user", "content": "again"}]}, 400, ("no content",), "messages"),
    "template_kwargs_return_dict": ({**user("hi"), "chat_template_kwargs": {"return_dict": True}}, 400,
                                    ("chat_template_kwargs",), "chat_template_kwargs"),
    "template_kwargs_tokenize": ({**user("hi"), "chat_template_kwargs": {"tokenize": True}}, 400,
                                 ("chat_template_kwargs",), "chat_template_kwargs"),
}


@pytest.fixture(scope="module")
def good_answer(server) -> dict:
    return assert_serves(server)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_then_good_request(server, good_answer, name):
    body, status, words, *param = CASES[name]
    with httpx.Client() as http:  # one keep-alive connection for both requests
        err = assert_error(post(server, body, http=http), status, *words)
        if status == 404:
            assert err["code"] == "model_not_found"
        if param:
            assert err["param"] == param[0], err
        assert assert_serves(server, http) == good_answer


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
    admission.limit, admission.in_flight = 2, admission.in_flight + 1  # one slot taken: n=2 must wait
    try:
        r = post(server, {**user("hi"), "n": 2})
        err = assert_error(r, 429, "queue is full")
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
    finally:
        admission.limit, admission.in_flight = limit, admission.in_flight - 1
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
