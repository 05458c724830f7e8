"""The server against hostile clients, round four (issue 45): nothing a client sends stalls the rest.

- Output constraints: refused past their size limits before compiling; compiled in their own pool, so
  text requests and /tokenize answer while compiles run; at most `max_pending_grammars` at once (429
  past that); a compile whose client left before it started never starts; the grammar cache is
  bounded in bytes, and the engine thread never compiles a grammar the server compiled.
- Prompt text that can never fit the context is a 400 before it is tokenized (/tokenize, completions,
  chat); the memory of a large body is handed back after it; /tokenize refuses a lone surrogate.
- `bad_words`: capped (400), tokenized before the engine thread sees them.
- Non-finite logprobs are JSON `null` (collected and streamed), never NaN or a 500.
- Tool calls: a key given twice and parallel calls read the same streamed and collected.
- A video that cannot fit the context is refused from its container, before a frame is decoded.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.server_fixtures import served_fixtures, wait_until_idle
from tests.test_server import data_uri
from vlmrun.engine.request_group import RequestGroup
from vlmrun.sampling_params import MAX_BAD_WORDS, SamplingParamError, SamplingParams
from vlmrun.server.chat_output import ChatOutputParser
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.responses import ChoiceState, chat_message
from vlmrun.server.settings import ServerSettings
from vlmrun.structured import StructuredOutputsParams
from vlmrun.structured.compiler import GrammarCompiler

MODEL = "tiny"


engine, server = served_fixtures(max_model_len=128, served_model_name=MODEL, settings={
    "trust_request_mm_kwargs": True, "enable_auto_tool_choice": True, "tool_call_parser": "hermes"})[:2]


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0, **extra}


def chat(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}], **extra}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------------- output constraints


def test_constraints_past_their_size_are_refused_before_compiling(server, engine, http, monkeypatch):
    compiled = []
    compiler = engine.engine.grammars
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: compiled.append(spec) or real(spec))
    started = time.monotonic()
    r = http.post("/v1/completions", json=completion(structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}))
    assert_error(r, 400, param="structured_outputs")
    assert "at most 1,024" in r.json()["error"]["message"]
    big_enum = {"type": "object", "properties": {"a": {"enum": [f"value number {i}" for i in range(5_000)]}}}
    r = http.post("/v1/chat/completions", json=chat(response_format={"type": "json_schema",
                                                                     "json_schema": {"name": "x", "schema": big_enum}}))
    assert_error(r, 400, param="response_format")
    r = http.post("/v1/completions", json=completion(guided_regex="a" * 70_000))
    assert_error(r, 400, param="guided_regex")
    assert time.monotonic() - started < 10
    assert compiled == []
    assert http.post("/v1/completions", json=completion(structured_outputs={"choice": ["yes", "no"]})).status_code == 200


@pytest.fixture()
def blocked_compiles(engine, monkeypatch):
    """Compiles wait for `release` (a slow grammar); `entered` lists the regexes that started compiling."""
    compiler = engine.engine.grammars
    real = compiler._compile
    release = threading.Event()
    entered: list[str] = []

    def slow(spec):
        entered.append(spec.regex)
        release.wait(60)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", slow)
    yield release, entered
    release.set()


def _post_in_thread(base_url: str, path: str, body: dict, timeout: float, out: list) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=timeout) as client:
                out.append(client.post(path, json=body))
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_compiles_never_hold_up_light_work_and_are_bounded_in_count(engine, blocked_compiles):
    release, entered = blocked_compiles
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, grammar_workers=2, max_pending_grammars=3))
    try:
        slow: list = []
        threads = [_post_in_thread(srv.base_url, "/v1/completions", completion(guided_regex=f"(yes|no){k}"), 60, slow)
                   for k in range(3)]
        _wait_for(lambda: len(entered) == 2 and srv.app.state.vlmrun.grammars.pending == 3)
        with httpx.Client(base_url=srv.base_url, timeout=10) as client:  # the light pool is free
            started = time.monotonic()
            assert client.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
            assert client.post("/v1/completions", json=completion()).status_code == 200
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
            assert time.monotonic() - started < 5
            r = client.post("/v1/completions", json=completion(guided_regex="(maybe)"))  # one compile too many
            assert_error(r, 429, code="grammar_compiles_busy")
            assert r.headers["retry-after"] == "1"
        release.set()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in slow] == [200, 200, 200]
    finally:
        srv.stop()
    wait_until_idle(engine)


def test_a_compile_whose_client_left_is_never_started(engine, blocked_compiles):
    release, entered = blocked_compiles
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, grammar_workers=1))
    try:
        first: list = []
        gone: list = []
        t1 = _post_in_thread(srv.base_url, "/v1/completions", completion(guided_regex="(first)"), 60, first)
        _wait_for(lambda: entered == ["(first)"])
        t2 = _post_in_thread(srv.base_url, "/v1/completions", completion(guided_regex="(abandoned)"), 0.5, gone)
        t2.join(10)
        assert isinstance(gone[0], httpx.TimeoutException)  # the client left while its compile was queued
        time.sleep(0.3)  # the server notices the disconnect
        release.set()
        t1.join(60)
        assert first[0].status_code == 200
        pool = srv.app.state.vlmrun.grammars
        _wait_for(lambda: pool.pending == 0)
        assert entered == ["(first)"]  # the abandoned one never compiled
    finally:
        srv.stop()
    wait_until_idle(engine)


def test_the_grammar_cache_is_bounded_in_bytes(engine):
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer), engine.engine.model_config.eos_token_ids,
                               cache_bytes=200_000)
    specs = [StructuredOutputsParams(choice=[f"option {k} {i}" for i in range(300)]) for k in range(8)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cached_bytes <= 200_000 or compiler.num_cached == 1
    assert 1 <= compiler.num_cached < len(specs)
    assert compiler.is_cached(specs[-1])
    evicted = StructuredOutputsParams(choice=specs[0].choice)  # the same text, a new spec: not pinned
    assert not compiler.is_cached(evicted)
    assert compiler.is_cached(specs[0])  # the spec it was compiled for keeps its grammar (the engine's use)


def test_the_engine_thread_never_compiles_what_the_server_compiled(server, engine, http, monkeypatch):
    compiler = engine.engine.grammars
    real = compiler._compile
    threads = []
    monkeypatch.setattr(compiler, "_compile", lambda spec: threads.append(threading.current_thread().name)
                        or real(spec))
    monkeypatch.setattr(compiler, "cache_bytes", 1)  # every grammar evicted as soon as another one compiles
    for k in range(3):
        r = http.post("/v1/completions", json=completion(structured_outputs={"regex": f"(a|b){k}"}))
        assert r.status_code == 200, r.text
    assert len(threads) == 3 and all(name.startswith("vlmrun-grammar") for name in threads), threads


# ---------------------------------------------------------------------------- prompt text


def test_prompt_text_that_cannot_fit_the_context_is_refused_before_tokenizing(server, engine, http, monkeypatch):
    bounds = server.app.state.vlmrun.limits.prompt
    assert bounds.max_model_len == 128
    too_long = "word " * (bounds.max_chars // 5 + 10)
    tokenizer = server.app.state.vlmrun.processor.tokenizer
    encoded = []
    real = type(tokenizer).encode
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, text, **kw: encoded.append(len(text))
                        or real(self, text, **kw))
    for path, body, param in (("/tokenize", {"prompt": too_long}, "prompt"),
                              ("/v1/completions", completion(prompt=too_long), "prompt"),
                              ("/v1/completions", completion(prompt=["hi", too_long]), "prompt"),
                              ("/v1/chat/completions", chat(messages=[{"role": "user", "content": too_long}]),
                               "messages"),
                              ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": too_long}]}]},
                               "messages")):
        err = assert_error(http.post(path, json=body), 400, param=param, code="context_length_exceeded")
        assert "maximum context length of 128 tokens" in err["message"]
    assert not any(n > bounds.max_chars for n in encoded)
    # under the bound the prompt is tokenized, and the engine's own context check answers
    r = http.post("/v1/completions", json=completion(prompt="word " * 200))
    assert_error(r, 400)
    # truncating requests may send more (they keep the prompt's end)
    r = http.post("/v1/completions", json=completion(prompt=too_long, truncate_prompt_tokens=20))
    assert r.status_code == 200, r.text


def test_a_realistic_huge_tokenize_body_is_refused_at_once(server, http):
    body = json.dumps({"prompt": "x" * (8 << 20)})
    started = time.monotonic()
    r = http.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert time.monotonic() - started < 5
    assert http.post("/tokenize", json={"prompt": "Hello"}).json()["count"] >= 1


def test_the_memory_of_a_large_body_is_handed_back(server, http, monkeypatch):
    trimmer = server.app.state.vlmrun.trimmer
    if trimmer._libc is None:
        pytest.skip("glibc only")
    monkeypatch.setattr(trimmer, "idle_s", 3600.0)  # no trim after the earlier tests' requests in between
    time.sleep(trimmer.delay_s + trimmer.min_interval_s + 0.3)  # a trim earlier tests asked for is done
    before = trimmer.trims
    assert http.post("/tokenize", json={"prompt": "small"}).status_code == 200
    time.sleep(trimmer.delay_s + 0.3)
    assert trimmer.trims == before  # small bodies cost nothing
    body = json.dumps({"prompt": "x" * (9 << 20)})
    assert http.post("/tokenize", content=body, headers={"content-type": "application/json"}).status_code == 400
    _wait_for(lambda: trimmer.trims == before + 1, timeout=10)


def test_tokenize_refuses_a_lone_surrogate(http):
    body = '{"prompt": "abc \\ud800 def"}'
    err = assert_error(http.post("/tokenize", content=body, headers={"content-type": "application/json"}), 400,
                       param="prompt")
    assert "surrogate" in err["message"]


# ---------------------------------------------------------------------------- bad_words


def test_bad_words_are_capped(http):
    words = [f"w{i}" for i in range(100_000)]
    for path, body in (("/v1/completions", completion(bad_words=words)), ("/v1/chat/completions", chat(bad_words=words)),
                       ("/v1/completions", completion(bad_words=["x" * 10_000]))):
        err = assert_error(http.post(path, json=body), 400, param="bad_words")
        assert f"at most {MAX_BAD_WORDS}" in err["message"]
    with pytest.raises(SamplingParamError, match="bad_words may hold"):
        SamplingParams(bad_words=words)


def test_bad_words_are_tokenized_before_the_engine_thread(server, engine, http, monkeypatch):
    calls = []
    real = SamplingParams.tokenize_bad_words

    def spy(self, tokenizer):
        calls.append((threading.current_thread() is engine._thread, bool(self.bad_words_token_ids)))
        return real(self, tokenizer)

    monkeypatch.setattr(SamplingParams, "tokenize_bad_words", spy)
    r = http.post("/v1/completions", json=completion(bad_words=["hello", "world"], n=2))
    assert r.status_code == 200, r.text
    on_engine = [tokenized for engine_thread, tokenized in calls if engine_thread]
    assert on_engine and all(on_engine), calls  # the engine thread only finds them done


def test_tokenized_bad_words_stay_tokenized(engine):
    params = SamplingParams(bad_words=["hello"], n=3, seed=1)
    tokenized = params.tokenize_bad_words(engine.tokenizer)
    assert tokenized.bad_words_token_ids and tokenized.tokenize_bad_words(engine.tokenizer) is tokenized
    assert all(c.bad_words_token_ids == tokenized.bad_words_token_ids for c in tokenized.choices())


# ---------------------------------------------------------------------------- non-finite logprobs


@pytest.fixture()
def nan_logprobs(monkeypatch):
    """The engine's logprobs turned NaN and +inf (a model gone wrong)."""
    real = RequestGroup.next_batch

    async def poisoned(self):
        batch = await real(self)
        for d in batch:
            d.logprobs = [{t: math.nan, t + 1: math.inf, t + 2: -math.inf} for t in d.token_ids]
        return batch

    monkeypatch.setattr(RequestGroup, "next_batch", poisoned)


def test_non_finite_logprobs_are_null_collected_and_streamed(http, nan_logprobs):
    r = http.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=3))
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(c["logprob"] is None for c in content)
    assert sorted(map(str, (t["logprob"] for t in content[0]["top_logprobs"]))) == ["-9999.0", "None", "None"]
    r = http.post("/v1/completions", json=completion(logprobs=2))
    assert r.status_code == 200, r.text
    assert all(lp is None for lp in r.json()["choices"][0]["logprobs"]["token_logprobs"])
    for path, body in (("/v1/chat/completions", chat(logprobs=True, stream=True)),
                       ("/v1/completions", completion(logprobs=1, stream=True))):
        r = http.post(path, json=body)
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "NaN" not in r.text and "Infinity" not in r.text
        chunks = [json.loads(e, parse_constant=lambda c: pytest.fail(f"{c} in the stream")) for e in events[:-1]]
        assert not any("error" in c for c in chunks)


# ---------------------------------------------------------------------------- tool calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "evil", "parameters": {"type": "object"}}}]


def _streamed(text: str, step: int) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ChatOutputParser(False, TOOLS)
    content, calls = "", {}
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    for out in pieces:
        content += out.content
        for c in out.calls:
            call = calls.setdefault(c.index, ["", ""])
            call[0] = c.name or call[0]
            call[1] += c.arguments
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def _collected(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    message = chat_message(ChoiceState(0, text=text, parsed=ChatOutputParser(False, TOOLS).parse_all(text)))
    return message["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "name": "evil", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, "name": "evil"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, "arguments": {"city": "x"}}\n</tool_call>',
])
def test_a_key_given_twice_reads_the_same_streamed_and_collected(text):
    for step in (1, 4, len(text)):
        assert _streamed(text, step) == _collected(text) == (None, [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("before, after", [("", ""), ("Sure, here:  \n", "\n\n"), ("\n", "  ")])
def test_parallel_calls_add_no_content_to_the_stream(before, after):
    calls = "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "C{i}"}}}}\n</tool_call>'
                      for i in range(12))
    text = before + calls + after
    for step in (1, 3, 7):
        content, streamed = _streamed(text, step)
        assert (content, streamed) == _collected(text)
        assert len(streamed) == 12 and (content or "") == before.rstrip()
    plain = "Just text, ends in spaces  \n"  # no calls: the whitespace is content, streamed too
    assert _streamed(plain, 2) == _collected(plain) == (plain, [])


# ---------------------------------------------------------------------------- video past the context


def test_a_video_past_the_context_is_refused_before_any_frame_is_decoded(server, http, tmp_path, monkeypatch):
    from testing.videos import write_video
    from vlmrun.processors import video_io
    from vlmrun.processors.video_io import video_decoder

    if video_decoder() != "torchcodec":
        pytest.skip("needs torchcodec")
    path = write_video(tmp_path / "clip.mp4", 40, 320, 320, 10.0, seed=1)
    decoded = []
    monkeypatch.setattr(video_io._TorchcodecVideo, "frames_at", lambda self, indices: decoded.append(indices))
    part = {"type": "video_url", "video_url": {"url": data_uri(path.read_bytes(), "video/mp4")}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]
    # 32 frames at full size: 1,600 tokens, far within the video limit (65,536), far past the context (128)
    r = http.post("/v1/chat/completions", json=chat(messages=messages, mm_processor_kwargs={"fps": 8.0,
                                                                                            "max_pixels": 10**7}))
    err = assert_error(r, 400, param="messages")
    assert "video" in err["message"] and "tokens" in err["message"]
    assert decoded == []
