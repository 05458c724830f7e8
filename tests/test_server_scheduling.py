"""The server's `priority` and `cache_salt` request fields (vLLM's), on both routes, with the openai client."""

from __future__ import annotations

import openai
import pytest

from tests.server_fixtures import MODEL, served_fixtures, tiny_engine
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

PROMPT = "Once upon a time there was a small red fox who lived at the edge of a very old forest."


engine, server, client = served_fixtures("qwen3_dir", scheduling_policy="priority", page_size=4)


def completion(client, **extra):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra)


def chat(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=2, temperature=0, extra_body=extra)


def hits(engine, create, client, **extra) -> int:
    before = engine.engine.prefix_cache_stats().hit_tokens
    create(client, **extra)
    return engine.engine.prefix_cache_stats().hit_tokens - before


@pytest.mark.parametrize("create", [completion, chat])
def test_cache_salt_isolates_prefix_hits(engine, client, create):
    salt = f"tenant-{create.__name__}"
    assert hits(engine, create, client, cache_salt=salt) == 0
    assert hits(engine, create, client, cache_salt=salt + "-other") == 0, "another salt never hits"
    assert hits(engine, create, client, cache_salt=salt) > 0, "the same salt hits"


@pytest.mark.parametrize("create", [completion, chat])
def test_priority_is_taken_and_checked(client, create):
    assert create(client, priority=-3).choices  # the priority policy takes any int
    for field, bad in (("priority", "high"), ("priority", 1.5), ("cache_salt", ""), ("cache_salt", 7)):
        with pytest.raises(openai.BadRequestError) as err:
            create(client, **{field: bad})
        assert err.value.body["param"] == field


def test_fcfs_server_refuses_a_priority(qwen3_dir):
    engine = tiny_engine(qwen3_dir)
    server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            completion(client, priority=1)
        assert err.value.body["param"] == "priority" and "not enabled" in err.value.body["message"]
        assert completion(client, priority=0).choices
    finally:
        server.stop()
        engine.shutdown()


def test_scheduling_policy_flag_reaches_the_engine_config(qwen3_dir):
    from tests.test_server_vllm_cli import serve_args
    from vlmrun.server.cli import engine_config

    assert engine_config(serve_args(qwen3_dir)).scheduling_policy == "fcfs"
    assert engine_config(serve_args(qwen3_dir, "--scheduling-policy", "priority")).scheduling_policy == "priority"
