"""Token-id fields longer than the vocabulary are refused when the body is parsed, before their entries
are read (issue 45, "no other client delayed more than 2 s"): a `logit_bias` of 100k entries cost about a
second of parsing and a vocabulary check on the engine's side for every such request."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from tests.server_fixtures import served_fixtures
from vlmrun.engine.async_engine import AsyncEngine

MODEL = "tiny"


engine, server = served_fixtures(max_model_len=128, served_model_name=MODEL)[:2]


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **extra}


def vocab(engine: AsyncEngine) -> int:
    return engine.engine.model_config.text_config.vocab_size


def test_a_logit_bias_longer_than_the_vocabulary_is_refused_before_it_is_read(engine, http, monkeypatch):
    from vlmrun.sampling_params import SamplingParams

    checked = []
    original = SamplingParams.check_token_ids
    monkeypatch.setattr(SamplingParams, "check_token_ids", lambda self, v: checked.append(1) or original(self, v))
    r = http.post("/v1/completions", json=completion(logit_bias={str(i): 1 for i in range(vocab(engine) + 1)}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and "entries; the vocabulary has" in err["message"], err
    assert checked == []  # refused when parsed: the engine never saw it


def test_a_logit_bias_id_past_the_vocabulary_is_refused_when_parsed(engine, http):
    r = http.post("/v1/completions", json=completion(logit_bias={"5": 1, str(vocab(engine)): 2}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert f"[0, {vocab(engine)}): {vocab(engine)}" in r.json()["error"]["message"]


def test_allowed_token_ids_longer_than_the_vocabulary_are_refused(engine, http):
    r = http.post("/v1/completions", json=completion(allowed_token_ids=[1] * (vocab(engine) + 1)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert "the vocabulary has" in r.json()["error"]["message"]


def test_a_full_vocabulary_logit_bias_still_works(engine, http):
    bias = {str(i): 0 for i in range(vocab(engine))}
    plain = http.post("/v1/completions", json=completion())
    biased = http.post("/v1/completions", json=completion(logit_bias=bias))
    assert plain.status_code == biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
