"""vLLM's start-up flags (`vlmrun/server/vllm_flags.py`): each parsed, carried to the config it sets, or
refused before the model loads with a message that says why and what to use instead; HTTPS from
`--ssl-keyfile/--ssl-certfile`, `--return-tokens-as-token-ids` as the server's default, and the
periodic statistics line `--disable-log-stats` turns off."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.test_server import MODEL, engine  # noqa: F401 (fixture)
from tests.test_server_vllm_cli import serve_args
from vlmrun.cli import build_parser, main
from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngineStats
from vlmrun.sampling_params import MAX_LOGPROBS
from vlmrun.server.cli import engine_config, server_settings
from vlmrun.server.launch import HTTPOptions, ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings
from vlmrun.server.stats_log import StatsLog
from vlmrun.server.vllm_flags import ENGINE_MAX_LOGPROBS


def test_engine_flags_reach_the_engine_config(qwen3_vl_dir):
    config = engine_config(serve_args(qwen3_vl_dir, "-tp", "1", "--kv-cache-dtype", "auto", "--scheduling-policy",
                                      "fcfs", "--block-size", "32", "--enable-chunked-prefill",
                                      "--limit-mm-per-prompt.image", "2", "--limit-mm-per-prompt.video", "0"))
    assert (config.tensor_parallel_size, config.kv_cache_dtype, config.scheduling_policy) == (1, "auto", "fcfs")
    assert (config.page_size, config.max_images_per_request, config.max_videos_per_request) == (32, 2, 0)
    both = engine_config(serve_args(qwen3_vl_dir, "--limit-mm-per-prompt", '{"image": 3}',
                                    "--limit-mm-per-prompt.video", "1"))
    assert (both.max_images_per_request, both.max_videos_per_request) == (3, 1)
    assert engine_config(serve_args(qwen3_vl_dir)).page_size == EngineConfig.page_size


def test_server_flags_reach_the_settings(qwen3_vl_dir):
    args = serve_args(qwen3_vl_dir, "--served-model-name", "a", "b", "c", "--max-logprobs", "-1",
                      "--trust-request-mm-kwargs", "--override-generation-config", '{"temperature": 0.25, '
                      '"max_new_tokens": 9}', "--return-tokens-as-token-ids", "--enable-log-requests",
                      "--disable-log-stats", "--allowed-origins", '["https://a.example"]', "--allow-credentials",
                      "--uvicorn-log-level", "debug", "--disable-uvicorn-access-log", "--root-path", "/llm/")
    settings = server_settings(args)
    assert (settings.served_model_name, settings.served_model_names) == ("a", ("a", "b", "c"))
    assert settings.max_logprobs == ENGINE_MAX_LOGPROBS == MAX_LOGPROBS
    assert settings.trust_request_mm_kwargs and settings.return_tokens_as_token_ids and settings.log_requests
    assert settings.sampling_overrides() == {"temperature": 0.25, "max_tokens": 9} and not settings.log_stats
    assert (settings.allowed_origins, settings.allow_credentials) == (("https://a.example",), True)
    http = HTTPOptions.of(args)
    assert (http.log_level, http.access_log, http.root_path, http.scheme) == ("debug", False, "/llm", "http")
    default = server_settings(serve_args(qwen3_vl_dir))
    assert (default.max_logprobs, default.log_requests, default.log_stats, default.allowed_origins) == (20, False, True,
                                                                                                        ("*",))
    legacy = build_parser().parse_args(["serve", "m", "--disable-log-requests"])
    assert not server_settings(legacy).log_requests


@pytest.mark.parametrize("flags, words", [
    (["--no-enable-chunked-prefill"], ["always prefills", "--max-num-batched-tokens"]),
    (["--tokenizer", "another/tokenizer"], ["--tokenizer another/tokenizer", "checkpoint"]),
    (["--tokenizer-mode", "slow"], ["--tokenizer-mode slow", "auto"]),
    (["--kv-cache-dtype", "int3"], ["kv_cache_dtype must be auto", "fp8_e4m3", "'int3'"]),
    (["--scheduling-policy", "lottery"], ["scheduling_policy must be fcfs or priority", "'lottery'"]),
    (["--max-logprobs", "50"], ["--max-logprobs 50", "at most 20"]),
    (["--override-generation-config", '{"temprature": 1}'], ["temprature", "temperature"]),
    (["--limit-mm-per-prompt", '{"image": 2}', "--limit-mm-per-prompt.image", "3"], ["disagree"]),
    (["--ssl-keyfile", "key.pem"], ["both --ssl-keyfile and --ssl-certfile"]),
    (["--ssl-keyfile", "absent-key.pem", "--ssl-certfile", "absent-cert.pem"], ["absent-key.pem", "no such file"]),
    (["--root-path", "llm"], ["--root-path", "start with '/'"]),
    (["-pp", "2"], ["--pipeline-parallel-size 2", "--tensor-parallel-size"]),
    (["-dp", "2"], ["--data-parallel-size 2", "load balancer"]),
    (["--load-format", "gguf"], ["--load-format gguf", "safetensors"]),
    (["--chat-template-content-format", "string"], ["string", "auto or openai"]),
])
def test_refused_flags_stop_the_server_before_loading(qwen3_vl_dir, capsys, flags, words):
    assert main(["serve", str(qwen3_vl_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_flags_without_meaning_here_are_accepted_with_a_log_line(qwen3_vl_dir, capsys):
    """--trust-remote-code and --swap-space are taken (vLLM scripts pass them) and said to mean nothing here;
    the busy port then stops the server before the model loads."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        code = main(["serve", str(qwen3_vl_dir), "--port", str(port), "--trust-remote-code", "--swap-space", "4",
                     "--tokenizer", str(qwen3_vl_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "already in use" in err
    assert "--trust-remote-code: accepted; vlmrun runs only its own model code" in err
    assert "--swap-space: accepted" in err


@pytest.fixture(scope="module")
def token_id_server(engine) -> Iterator[ServerThread]:  # noqa: F811
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, return_tokens_as_token_ids=True))
    yield srv
    srv.stop()


def test_return_tokens_as_token_ids_is_the_servers_default(token_id_server):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 1}
    tokens = httpx.post(token_id_server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert all(t.startswith("token_id:") for t in tokens["choices"][0]["logprobs"]["tokens"])
    own = httpx.post(token_id_server.base_url + "/v1/completions", json={**body, "return_tokens_as_token_ids": False},
                     timeout=60).json()
    assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_ssl_flags_serve_https(engine, tmp_path: Path):  # noqa: F811
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    args = build_parser().parse_args(["serve", "m", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    http = HTTPOptions.of(args)
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL), http=http)
    try:
        assert srv.base_url.startswith("https://")
        assert httpx.get(srv.base_url + "/health", verify=False, timeout=30).json() == {"status": "ok"}
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not answered
            httpx.get(srv.base_url.replace("https://", "http://") + "/health", timeout=5)
    finally:
        srv.stop()


def test_stats_line_reports_throughput_and_is_quiet_when_idle():
    stats = AsyncEngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=100)
    totals = [0, 0]
    log = StatsLog(lambda: stats, lambda: (totals[0], totals[1]), interval_s=10.0)
    assert log.line() is None  # nothing ran
    totals[:] = [120, 30]
    stats = AsyncEngineStats(num_running=2, num_waiting=1, kv_pages_used=25, kv_pages_total=100,
                             prefix_query_tokens=100, prefix_hit_tokens=40)
    line = log.line()
    assert line is not None and "running 2" in line and "waiting 1" in line and "KV cache 25.0% used" in line
    assert "prefix cache hit rate 40.0%" in line and "tokens/s" in line
    stats = AsyncEngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=100,
                             prefix_query_tokens=100, prefix_hit_tokens=40)
    assert log.line() is None  # idle again


def test_request_and_stats_lines_are_shown_on_stderr(capsys):
    """`vlmrun serve` shows the --enable-log-requests lines and the statistics line on stderr (the server's
    other INFO logs stay quiet); each is attached once."""
    import logging

    from vlmrun.server.vllm_flags import show_server_logs

    loggers = [logging.getLogger("vlmrun.server.requests"), logging.getLogger("vlmrun.server.stats")]
    before = [(log.handlers[:], log.level) for log in loggers]
    try:
        show_server_logs(log_requests=True, log_stats=False)
        show_server_logs(log_requests=True, log_stats=False)
        assert len(loggers[0].handlers) == len(before[0][0]) + 1 and loggers[1].handlers == before[1][0]
        loggers[0].info("request x: shown")
        logging.getLogger("vlmrun.server.app").info("not shown")
        err = capsys.readouterr().err
        assert "vlmrun.server.requests: request x: shown" in err and "not shown" not in err
    finally:
        for log, (handlers, level) in zip(loggers, before):
            log.handlers[:] = handlers
            log.setLevel(level)
