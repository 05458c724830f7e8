"""`vlmrun serve`'s flags for output constraints reach the server: the size bounds a request is checked
against, the compile pool's threads, queue and wait, and the bytes the engine's grammar cache keeps
(`vlmrun/server/grammar_options.py`; the cache's default from vLLM's VLLM_XGRAMMAR_CACHE_MB)."""

from __future__ import annotations

import argparse

import httpx
import pytest

from tests.server_fixtures import served_fixtures
from vlmrun.server import cli
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import MiB

FLAGS = ["--max-grammar-chars", "300", "--max-grammar-choices", "3", "--grammar-workers", "3",
         "--max-pending-grammars", "5", "--grammar-compile-timeout", "7.5", "--grammar-cache-mb", "12"]


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


engine = served_fixtures(max_model_len=128)[0]


def test_the_defaults_are_the_settings_defaults(monkeypatch) -> None:
    from vlmrun.server.settings import ServerSettings

    monkeypatch.delenv("VLLM_XGRAMMAR_CACHE_MB", raising=False)
    settings = cli.server_settings(serve_args())
    defaults = ServerSettings(served_model_name="x")
    for name in ("max_grammar_chars", "max_grammar_choices", "grammar_workers", "max_pending_grammars",
                 "grammar_timeout_s", "grammar_cache_bytes"):
        assert getattr(settings, name) == getattr(defaults, name), name


def test_the_flags_reach_the_server(engine) -> None:
    settings = cli.server_settings(serve_args(*FLAGS))
    srv = serve_in_thread(engine, settings)
    try:
        state = srv.app.state.vlmrun
        assert (state.limits.grammar.max_source_chars, state.limits.grammar.max_choices) == (300, 3)
        assert state.grammars._pool._max_workers == 3
        assert (state.grammars.max_pending, state.grammars.timeout_s) == (5, 7.5)
        assert engine.engine.grammars.cache_bytes == 12 * MiB
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            body = {"model": settings.served_model_name, "prompt": "Pick", "max_tokens": 2,
                    "structured_outputs": {"choice": ["a", "b", "c", "d"]}}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"], r.text
            body["structured_outputs"] = {"regex": "a" * 301}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and "at most 300" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_the_cache_size_defaults_to_vllms_variable(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "64")
    assert cli.server_settings(serve_args()).grammar_cache_bytes == 64 * MiB
    assert cli.server_settings(serve_args("--grammar-cache-mb", "32")).grammar_cache_bytes == 32 * MiB


@pytest.mark.parametrize("flag, value", [("--grammar-workers", "0"), ("--grammar-compile-timeout", "0"),
                                         ("--grammar-cache-mb", "0"), ("--max-grammar-choices", "0")])
def test_a_bad_value_is_refused(flag: str, value: str) -> None:
    with pytest.raises(ValueError):
        cli.server_settings(serve_args(flag, value))
