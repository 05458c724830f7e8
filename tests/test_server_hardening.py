"""The server as a hostile client meets it (issue 20): internal errors, metrics, model cards, fuzzing.

- An unexpected exception is a JSON 500, the keep-alive connection stays usable, and /metrics
  counts it (every status class shows there); a stream that fails half-way ends with an error
  event and [DONE], its connection usable too.
- /v1/models shows the served name, never the model's local path.
- Property test: request bodies drawn from the OpenAI request shape with hostile values (wrong
  types, NaN / Infinity, huge integers, unknown roles, odd content parts, reserved template
  arguments) get 2xx or 4xx, never 5xx, and the server answers a good request after each batch.
"""

from __future__ import annotations

import json
import re
from typing import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_fixtures import served_fixtures, wait_until_idle
from tests.test_server import data_uri, picture, png_bytes
from vlmrun.server import chat_handler

MODEL = "tiny"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


engine, server = served_fixtures(max_model_len=128, settings={"api_key": KEY, "max_n": 4},
                                 served_model_name=MODEL)[:2]


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    """One keep-alive connection to the server."""
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def chat_body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}], **extra}


def answer(http: httpx.Client) -> str:
    r = http.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def status_counts(http: httpx.Client) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vlmrun_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = counts.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


# ---------------------------------------------------------------------------- internal errors


def test_internal_error_is_a_500_that_keeps_the_connection_and_is_counted(server, http, monkeypatch):
    before = answer(http)
    media = server.app.state.vlmrun.media

    def boom(messages):
        raise RuntimeError("boom")

    monkeypatch.setattr(media, "resolve_messages", boom)
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json=chat_body(stream=stream))
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error" and "boom" in err["message"]
    monkeypatch.undo()
    assert answer(http) == before  # the same connection, the same answer
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code == 400
    assert http.get("/v1/models/other").status_code == 404
    counts = status_counts(http)
    for status in ("200", "400", "404", "500"):
        assert counts.get(status, 0) >= 1, (status, counts)
    assert counts["500"] >= 2


def test_a_stream_that_fails_half_way_ends_cleanly(server, engine, http, monkeypatch):
    before = answer(http)

    def broken(batch):
        raise RuntimeError("broken stream")

    monkeypatch.setattr(chat_handler, "merge_batch", broken)
    r = http.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and "broken stream" in error["message"]
    monkeypatch.undo()
    assert answer(http) == before
    wait_until_idle(engine)


def test_models_show_the_served_name_not_the_local_path(server, engine, http):
    path = str(engine.engine.model_config.path)
    for url in ("/v1/models", f"/v1/models/{MODEL}"):
        r = http.get(url)
        assert r.status_code == 200
        assert path not in r.text and path.rstrip("/").rsplit("/", 1)[-1] not in r.text
    assert http.get("/v1/models").json()["data"][0]["root"] == MODEL


# ---------------------------------------------------------------------------- fuzzing
# A body is a valid request (random valid values) with up to three fields replaced by hostile
# values, so that most examples get past the first check and reach templates, images and the engine.

EDGES = st.sampled_from([None, True, False, 0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308,
                         -1e308, float("nan"), float("inf"), float("-inf"), 0.5, "", "x", "1", [], {}, [1.5], ["a"],
                         [-1], [2**64], {"a": None}])
INTS = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]))
DEEP = st.integers(60, 5000).map(lambda depth: f"<deep {depth}>")  # nested arrays, spelt out by `encode`
HOSTILE = st.one_of(
    EDGES, EDGES, EDGES, INTS, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.one_of(st.integers(-2, 5), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), DEEP,
)
PNG = data_uri(png_bytes(picture(24, 20, 1)))
URLS = st.sampled_from([PNG, "data:image/png;base64,@@", "http://127.0.0.1:9/x.png", "http://[::ffff:127.0.0.1]/x",
                        "http://2130706433/x", "file:///etc/passwd", "/dev/zero", "ftp://x/y", ""])
TEXT = st.text(max_size=20)
VALID_PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                       st.just({"type": "image_url", "image_url": {"url": PNG}}))
HOSTILE_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": HOSTILE}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": st.one_of(URLS, HOSTILE)}), HOSTILE)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "video_url", "input_audio", "nope", ""])},
                          optional={"image": st.one_of(URLS, HOSTILE)}),
    HOSTILE)
VALID_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                                       "content": st.one_of(TEXT, st.lists(VALID_PART, min_size=1, max_size=2))})
HOSTILE_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "tool", "function", "wizard", ""]), HOSTILE)},
    optional={"content": st.one_of(TEXT, st.lists(st.one_of(VALID_PART, HOSTILE_PART), max_size=3), HOSTILE),
              "tool_call_id": st.one_of(st.just("c1"), HOSTILE),
              "tool_calls": st.one_of(st.just([{"id": "c1", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]), HOSTILE)})
VALID = {
    "model": st.just(MODEL), "max_tokens": st.integers(1, 3), "n": st.integers(1, 2),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 2000), max_size=3), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
CHAT = {**VALID, "messages": st.one_of(st.lists(VALID_MESSAGE, min_size=1, max_size=3),
                                      st.lists(st.one_of(VALID_MESSAGE, HOSTILE_MESSAGE), min_size=1, max_size=3)),
        "logprobs": st.booleans(),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
        "add_generation_prompt": st.booleans()}
COMPLETION = {**VALID, "prompt": st.one_of(TEXT.filter(str.strip), st.lists(st.integers(0, 300), min_size=1,
                                                                           max_size=4)),
              "logprobs": st.integers(0, 5)}
HOSTILE_FIELDS = {
    "messages": st.one_of(HOSTILE, st.lists(HOSTILE_MESSAGE, min_size=1, max_size=3)),
    "prompt": st.one_of(HOSTILE, st.lists(INTS, max_size=4), st.lists(st.lists(INTS, max_size=3), max_size=2)),
    "chat_template_kwargs": st.one_of(HOSTILE, st.dictionaries(
        st.sampled_from(["tokenize", "return_dict", "messages", "tools", "add_generation_prompt", "chat_template",
                         "continue_final_message", "x"]), HOSTILE, max_size=2)),
    "stop": st.one_of(HOSTILE, st.lists(st.text(max_size=600), max_size=40)),
    "top_logprobs": HOSTILE, "echo": HOSTILE, "logit_bias": HOSTILE, "tools": HOSTILE, "suffix": HOSTILE, "best_of": HOSTILE,
    "response_format": st.one_of(st.fixed_dictionaries({"type": HOSTILE}), HOSTILE),
    "max_completion_tokens": HOSTILE,
}


@st.composite
def bodies(draw, valid: dict) -> dict:
    names = sorted(valid)
    required = {"messages", "prompt", "max_tokens"}
    body = {k: draw(valid[k]) for k in names if k in required or draw(st.booleans())}
    if body.get("stream") is not True:
        body.pop("stream_options", None)  # valid only with stream true (a 400 otherwise)
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names + sorted(set(HOSTILE_FIELDS) - set(valid) - {"messages", "prompt"})))
        body[name] = draw(HOSTILE_FIELDS.get(name, HOSTILE))
    return body


FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def encode(body: dict) -> str:
    """JSON with NaN / Infinity literals (part of the attack) and each "<deep N>" as N nested arrays."""
    return re.sub(r'"<deep (\d+)>"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), json.dumps(body, allow_nan=True))


def post_fuzzed(http: httpx.Client, path: str, body: dict) -> int:
    raw = encode(body)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    return r.status_code


@pytest.mark.parametrize("path, valid", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_fuzzed_requests_never_get_a_5xx(server, engine, http, path, valid):
    before = answer(http)
    statuses: list[int] = []

    @FUZZ
    @given(body=bodies(valid))
    def one(body):
        statuses.append(post_fuzzed(http, path, body))

    one()
    assert answer(http) == before
    assert http.get("/health").json() == {"status": "ok"}
    wait_until_idle(engine)
    assert server.app.state.vlmrun.admission.in_flight == 0
    assert statuses.count(200) >= len(statuses) // 5, "the fuzzer should reach the engine often"
