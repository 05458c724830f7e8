"""The server's non-streamed requests run final-only in the engine (`Engine.add_request(..., stream=False)`).

- A non-streamed chat, completion, embedding or beam-search round reaches the engine with stream=False, a
  streamed one with stream=True.
- A non-streamed body is the one the server answered when it added every request streamed (the engine forced
  to stream=True here, which is what the server did before): greedy with logprobs, a stop string, n=2
  sampled with a seed, a length finish, `echo` with prompt logprobs, `return_token_ids`.
- The metrics, for non-streamed and for streamed requests alike: generated tokens = the outputs' tokens, one
  inter-token latency per output token after a choice's first, one time to first token per choice (per
  request in vlmrun's series), the tokens-per-step histogram's sum = prompt + generated tokens.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import MODEL, served_fixtures, wait_until_idle
from vlmrun.engine.async_engine import AsyncEngine

engine, server = served_fixtures()[:2]


class AddSpy:
    """Records the `stream` of each request the engine thread adds (`Engine.add_request`), and with
    `force_stream` submits every group streamed (`AsyncEngine.submit(stream=True)`), as the server did before
    it added non-streamed requests final-only: the reference the bodies are compared with."""

    def __init__(self, engine: AsyncEngine):
        self.add_request, self.submit = engine.engine.add_request, engine.submit
        self.streams: list[bool] = []
        self.force_stream = False

    def add(self, *args: Any, stream: bool = True, **kwargs: Any) -> None:
        self.streams.append(stream)
        return self.add_request(*args, stream=stream, **kwargs)

    async def submit_group(self, *args: Any, **kwargs: Any) -> Any:
        if self.force_stream:
            kwargs["stream"] = True
        return await self.submit(*args, **kwargs)


@pytest.fixture(scope="module")
def spy(engine: AsyncEngine) -> Iterator[AddSpy]:
    spy = AddSpy(engine)
    engine.engine.add_request, engine.submit = spy.add, spy.submit_group
    yield spy
    del engine.engine.add_request, engine.submit


def post(server, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + route, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream_lines(server, route: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", server.base_url + route, json={"model": MODEL, **body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_non_streamed_requests_reach_the_engine_final_only(engine, server, spy):
    spy.streams.clear()
    post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "n": 2})
    post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert spy.streams == [False, False, False]
    stream_lines(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3})
    stream_lines(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert spy.streams[3:] == [True, True]
    spy.streams.clear()
    post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
                                     "use_beam_search": True, "best_of": 2, "ignore_eos": True})
    assert spy.streams and not any(spy.streams)  # every round of the search
    wait_until_idle(engine)


def body_cases(server) -> list[tuple[str, dict[str, Any]]]:
    """The requests whose bodies are compared (a stop string taken from a greedy answer, so that it stops)."""
    greedy = post(server, "/v1/completions", {"prompt": "The sea at dawn", "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True})["choices"][0]["text"]
    stop = greedy[2:5] if len(greedy) >= 5 else greedy[:1]
    chat = [{"role": "user", "content": "Describe the sky."}]
    return [
        ("/v1/completions", {"prompt": "The sea at dawn", "max_tokens": 6, "temperature": 0, "logprobs": 2,
                             "ignore_eos": True}),
        ("/v1/completions", {"prompt": "The sea at dawn", "max_tokens": 8, "temperature": 0, "stop": [stop],
                             "ignore_eos": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": ["One", "Two two"], "max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 2,
                             "ignore_eos": True, "return_token_ids": True}),
        ("/v1/completions", {"prompt": "Echo me", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 7, "temperature": 0, "logprobs": True,
                                  "top_logprobs": 2, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "temperature": 0, "stop": [stop]}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2,
                                  "ignore_eos": True, "prompt_logprobs": 1, "return_token_ids": True}),
    ]


def without_ids(body: dict[str, Any]) -> str:
    """The body as JSON text, in its order, without what differs per request (its id and creation time)."""
    return json.dumps({k: v for k, v in body.items() if k not in ("id", "created")})


def test_non_streamed_bodies_are_what_the_streamed_engine_gave(server, spy):
    for route, body in body_cases(server):
        spy.force_stream = True
        try:
            reference = post(server, route, body)
        finally:
            spy.force_stream = False
        spy.streams.clear()
        final = post(server, route, body)
        assert spy.streams and not any(spy.streams)  # (this one ran final-only)
        assert without_ids(final) == without_ids(reference), (route, body)
    assert any(c.get("finish_reason") == "stop" and c.get("stop_reason") for route, body in body_cases(server)[1:2]
               for c in post(server, route, body)["choices"])  # the stop case stops on its string


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics, by name and labels (as `name{k=v,...}`), summed over the other labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics", timeout=30).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if "finished_reason" in s.labels:
                key = f"{s.name}{{{s.labels['finished_reason']}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_token_metrics_of_non_streamed_and_streamed_requests(engine, server, stream):
    wait_until_idle(engine)
    before = scrape(server)
    max_tokens = [1, 4, 7]
    for k in max_tokens:
        body = {"prompt": f"Count to {k}", "max_tokens": k, "temperature": 0, "ignore_eos": True}
        if stream:
            stream_lines(server, "/v1/completions", body)
        else:
            post(server, "/v1/completions", body)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2, "temperature": 0,
            "ignore_eos": True}
    stream_lines(server, "/v1/chat/completions", chat) if stream else post(server, "/v1/chat/completions", chat)
    wait_until_idle(engine)
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    outputs = max_tokens + [5, 5]  # per choice
    assert delta("vllm:generation_tokens_total") == delta("vlmrun_generation_tokens_total") == sum(outputs)
    assert delta("vllm:inter_token_latency_seconds_count") == sum(k - 1 for k in outputs)
    assert delta("vllm:time_per_output_token_seconds_count") == sum(k - 1 for k in outputs)
    assert delta("vllm:inter_token_latency_seconds_sum") > 0
    assert delta("vllm:time_to_first_token_seconds_count") == len(outputs)
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vlmrun_time_to_first_token_seconds_count") == 4  # per request
    assert delta("vlmrun_time_per_output_token_seconds_count") == sum(k > 1 for k in outputs)
    assert delta("vllm:request_time_per_output_token_seconds_count") == sum(k > 1 for k in outputs)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(outputs)
    assert delta("vllm:request_generation_tokens_sum") == sum(outputs)
    assert delta("vllm:request_max_num_generation_tokens_sum") == sum(max_tokens) + 5
    assert delta("vllm:request_success_total{length}") == len(outputs)
    assert delta("vllm:iteration_tokens_total_sum") == delta("vllm:prompt_tokens_total") + sum(outputs)
    assert delta("vllm:iteration_tokens_total_count") >= max(max_tokens)
