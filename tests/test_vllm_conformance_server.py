"""`vlmrun serve` driven as a vLLM user's script drives `vllm serve` (issue 50, part 2).

One server is started from a `serve` command line of vLLM's flags (parsed as `vllm serve` parses them:
`-tp`, `--uvicorn-log-level`, several `--served-model-name`, `--max-logprobs`, `--limit-mm-per-prompt.image`,
`--override-generation-config`, `--return-tokens-as-token-ids`, `--root-path`, `--allowed-origins`,
`--enable-log-requests`, ...), then used through the `openai` client: every model name answers, choices
carry `stop_reason` (collected and streamed) as vLLM's do, a request past `--max-logprobs` is a 400, and
`/metrics` has every `vllm:` series the official vLLM Grafana dashboard queries.
"""

from __future__ import annotations

import logging
import re
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server_vllm_cli import Served, serve_args
from vlmrun.server.cli import engine_config, server_settings
from vlmrun.server.launch import HTTPOptions, build_engine, serve_in_thread

NAMES = ("first-name", "second-name")
ROOT = "/proxy/llm"

# The series the panels of vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# query, each filtered by model_name="$model_name"; its model_name variable lists label_values({__name__=~"vllm:.*"},
# model_name). Written out here by hand from the dashboard's panels.
DASHBOARD_QUERIES = (
    "histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=~M}[1m])))",
    "rate(vllm:e2e_request_latency_seconds_sum{model_name=~M}[1m]) / rate(vllm:e2e_request_latency_seconds_count{model_name=~M}[1m])",
    "rate(vllm:prompt_tokens_total{model_name=~M}[1m])",
    "rate(vllm:generation_tokens_total{model_name=~M}[1m])",
    "histogram_quantile(0.9, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name=~M}[1m])))",
    "rate(vllm:time_per_output_token_seconds_sum{model_name=~M}[1m]) / rate(vllm:time_per_output_token_seconds_count{model_name=~M}[1m])",
    "vllm:num_requests_running{model_name=~M}",
    "vllm:num_requests_waiting{model_name=~M}",
    "histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~M}[1m])))",
    "rate(vllm:time_to_first_token_seconds_sum{model_name=~M}[1m]) / rate(vllm:time_to_first_token_seconds_count{model_name=~M}[1m])",
    "vllm:gpu_cache_usage_perc{model_name=~M}",
    "sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name=~M}[1m]))",
    "sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name=~M}[1m]))",
    "sum by(finished_reason) (increase(vllm:request_success_total{model_name=~M}[1m]))",
    "rate(vllm:request_queue_time_seconds_sum{model_name=~M}[1m])",
    "rate(vllm:request_prefill_time_seconds_sum{model_name=~M}[1m])",
    "rate(vllm:request_decode_time_seconds_sum{model_name=~M}[1m])",
    "rate(vllm:request_max_num_generation_tokens_sum{model_name=~M}[1m])",
)
# The further vLLM series the issue names, by type
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:cpu_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


@pytest.fixture(scope="module")
def vllm_server(qwen3_vl_dir) -> Iterator[Served]:
    """A server started from a `vllm serve`-style command line."""
    args = serve_args(qwen3_vl_dir, "-tp", "1", "--uvicorn-log-level", "warning", "--served-model-name", *NAMES,
                      "--max-logprobs", "3", "--limit-mm-per-prompt.image", "1", "--trust-remote-code",
                      "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--scheduling-policy", "fcfs",
                      "--override-generation-config", '{"max_new_tokens": 5}', "--root-path", ROOT,
                      "--allowed-origins", '["https://app.example"]', "--enable-log-requests", "--max-log-len", "5",
                      "--disable-log-stats", "--tokenizer", str(qwen3_vl_dir),
                      "--response-role", "narrator", "--enable-force-include-usage")
    eng = build_engine(engine_config(args))
    srv = serve_in_thread(eng, server_settings(args), http=HTTPOptions.of(args))
    yield Served(srv.base_url, eng)
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.base_url + ROOT + "/v1", api_key="EMPTY", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, model: str = NAMES[0], **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    return client.chat.completions.create(model=model, temperature=0, **kwargs)


def test_every_served_name_answers_and_the_first_is_reported(client):
    listed = [m.id for m in client.models.list().data]
    assert listed[:2] == list(NAMES)
    for name in NAMES:
        answer = chat(client, model=name, max_tokens=2)
        assert answer.model == NAMES[0] and answer.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        chat(client, model="another-name", max_tokens=1)


def test_override_generation_config_sets_the_default_length(client):
    """--override-generation-config '{"max_new_tokens": 5}': a request that sets no max_tokens gets 5."""
    answer = chat(client, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
    assert chat(client, max_tokens=7, extra_body={"ignore_eos": True}).usage.completion_tokens == 7


def test_stop_reason_names_the_stop_string_or_token(client):
    """vLLM's choices carry stop_reason: the stop string or stop token id that ended them, else null."""
    plain = chat(client, max_tokens=8, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and choice.model_extra["stop_reason"] is None
    text, ids = choice.message.content, choice.model_extra["token_ids"]
    stop_text = text[len(text) // 2:len(text) // 2 + 2]
    by_string = chat(client, max_tokens=8, stop=[stop_text], extra_body={"ignore_eos": True}).choices[0]
    assert (by_string.finish_reason, by_string.model_extra["stop_reason"]) == ("stop", stop_text)
    by_token = chat(client, max_tokens=8, extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]}).choices[0]
    assert (by_token.finish_reason, by_token.model_extra["stop_reason"]) == ("stop", ids[3])

    completion = client.completions.create(model=NAMES[1], prompt="Once upon a time", max_tokens=8, temperature=0,
                                           stop=[stop_text], extra_body={"ignore_eos": True})
    got = completion.choices[0]
    assert got.model_extra["stop_reason"] == (stop_text if got.finish_reason == "stop" else None)

    chunks = list(chat(client, max_tokens=8, stop=[stop_text], stream=True, extra_body={"ignore_eos": True}))
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(last) == 1 and (last[0].finish_reason, last[0].model_extra["stop_reason"]) == ("stop", stop_text)
    streamed = client.completions.create(model=NAMES[0], prompt="Once upon a time", max_tokens=4, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    ends = [c.choices[0] for c in streamed if c.choices and c.choices[0].finish_reason is not None]
    assert len(ends) == 1 and ends[0].finish_reason == "length" and ends[0].model_extra["stop_reason"] is None


def test_response_role_and_forced_usage(vllm_server):
    """--response-role names the answer's role; --enable-force-include-usage ends every stream with its usage."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["message"]["role"] == "narrator"
    with httpx.stream("POST", vllm_server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"role":"narrator"' in events[0]
    assert '"usage":{"prompt_tokens"' in events[-2] and '"choices":[]' in events[-2]


def test_max_logprobs_refuses_more_as_vllm(client):
    assert len(chat(client, max_tokens=1, logprobs=True, top_logprobs=3).choices[0].logprobs.content[0].top_logprobs) == 3
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=1, logprobs=True, top_logprobs=4)
    assert err.value.body["param"] == "top_logprobs" and "--max-logprobs" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt="Hi", max_tokens=1, logprobs=5)
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt="Hi", max_tokens=1, extra_body={"prompt_logprobs": 4})
    assert err.value.body["param"] == "prompt_logprobs"


def test_root_path_cors_and_request_log(vllm_server, caplog):
    """--root-path serves the API under the proxy's prefix (and the bare paths); --allowed-origins answers CORS;
    --enable-log-requests logs each request."""
    bare = httpx.get(vllm_server.base_url + "/v1/models", timeout=30)
    assert bare.status_code == 200 and bare.json()["data"][0]["id"] == NAMES[0]
    preflight = httpx.options(vllm_server.base_url + ROOT + "/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(vllm_server.base_url + "/health", headers={"Origin": "https://elsewhere.example"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
    with caplog.at_level(logging.INFO, logger="vlmrun.server.requests"):
        httpx.post(vllm_server.base_url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 1},
                   timeout=60)
    assert any(re.search(r"request cmpl-\w+: 1 choice\(s\), \d+ prompt tokens, prompt 'Hello',", r.getMessage())
               for r in caplog.records)


def _scrape(base_url: str) -> dict[str, tuple[str, list]]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def test_metrics_have_every_series_a_vllm_dashboard_queries(client, vllm_server):
    chat(client, max_tokens=4, n=2, extra_body={"ignore_eos": True})
    families = _scrape(vllm_server.base_url)
    samples = {}
    for _, (kind, family_samples) in families.items():
        for s in family_samples:
            samples.setdefault(s.name, []).append(s)
    for query in DASHBOARD_QUERIES:
        for series in re.findall(r"vllm:[a-z0-9_:]+", query):
            found = [s for s in samples.get(series, []) if s.labels.get("model_name") == NAMES[0]]
            assert found, f"{series} (queried by {query!r}) is not in /metrics"
            assert all(s.labels.get("engine") == "0" for s in found)
    for name, kind in VLLM_TYPES.items():
        assert families[name][0] == kind, name
    vllm_series = [s for name, ss in samples.items() if name.startswith("vllm:") for s in ss]
    assert vllm_series and all(s.labels.get("model_name") == NAMES[0] for s in vllm_series)  # the model_name variable

    def value(series: str, **labels) -> float:
        return sum(s.value for s in samples[series] if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:request_success_total", finished_reason="length") >= 2
    assert {s.labels["finished_reason"] for s in samples["vllm:request_success_total"]} >= {"stop", "length", "abort"}
    assert value("vllm:generation_tokens_total") >= 8 and value("vllm:prompt_tokens_total") > 0
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                      "vllm:request_decode_time_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:request_generation_tokens", "vllm:iteration_tokens_total"):
        assert value(histogram + "_count") >= 1, histogram
    assert value("vllm:request_max_num_generation_tokens_sum") >= 4 and value("vllm:request_params_n_sum") >= 2
    assert value("vllm:iteration_tokens_total_sum") >= value("vllm:generation_tokens_total")
    assert value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc")
    assert any(name.startswith("vlmrun_") for name in families)  # vlmrun's own, beside them


def test_a_non_list_tool_calls_is_not_a_server_error(vllm_server):
    """(Found by tests/test_server_hardening.py's fuzzing once this branch's fields moved its examples:) a user
    message with `"tool_calls": true` was a 500 from the prompt-size estimate; it is answered, never a 5xx."""
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"},
                                          {"role": "user", "content": "", "tool_calls": True}]}
    assert httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code < 500
