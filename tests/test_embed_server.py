"""`/v1/embeddings` on a server started for pooling, and run-batch lines for it.

Driven by the official `openai` client (and httpx for the raw shapes): the `input` forms (string, list
of strings, token ids, list of token-id lists) and vLLM's `messages` form with an image, float and
base64 encodings, `usage`, and the vectors equal `LLM.embed`'s for the same prompts; bad bodies are 400s
in OpenAI's error shape naming the field; the other kind of route on each kind of server is a 400 that
says how to start the right one; a run-batch line with url /v1/embeddings gets the server's answer.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server_fixtures import served_fixtures, tiny_engine, wait_until_idle
from tests.test_run_batch import ENGINE_FLAGS, _outputs, _write_lines
from tests.test_server import data_uri, image_part, picture, png_bytes
from vlmrun import LLM
from vlmrun.cli import main
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny-embed"
TEXTS = ["a red cup on the table", "the sea and the sky"]


engine, server, client = served_fixtures(runner="pooling", served_model_name=MODEL)


@pytest.fixture(scope="module")
def offline(qwen3_vl_dir) -> LLM:
    return LLM(str(qwen3_vl_dir), runner="pooling", dtype="float32", device="cpu")


def test_input_forms_usage_and_equal_llm_embed(client, offline, engine):
    tok = offline.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    for given in (TEXTS, ids):
        res = client.embeddings.create(model=MODEL, input=given, encoding_format="float")
        assert [d.index for d in res.data] == [0, 1]
        np.testing.assert_allclose([d.embedding for d in res.data], want, atol=1e-5)
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    single_ids = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[0], atol=1e-5)
    np.testing.assert_allclose(single_ids.data[0].embedding, want[1], atol=1e-5)
    wait_until_idle(engine)  # prefill-only: nothing held after the answer


def test_base64_and_messages_with_an_image(server, offline):
    url = server.base_url + "/v1/embeddings"
    as_float = httpx.post(url, json={"model": MODEL, "input": TEXTS[0]}).json()
    as_b64 = httpx.post(url, json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(as_float["data"][0]["embedding"], dtype=np.float32))
    assert as_float["object"] == "list" and as_float["data"][0]["object"] == "embedding"
    image = picture(70, 50, 3)
    messages = [{"role": "user", "content": [image_part(data_uri(png_bytes(image))),
                                             {"type": "text", "text": "a picture"}]}]
    got = httpx.post(url, json={"model": MODEL, "messages": messages}).json()
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "a picture"}]}]
    prompt = offline.engine.processor.process_chat(chat, add_generation_prompt=False)
    want = offline.embed([prompt], use_tqdm=False)[0]
    np.testing.assert_allclose(got["data"][0]["embedding"], want.outputs.embedding, atol=1e-5)
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "max_tokens": 5}, "max_tokens"),
    ({"input": "hi", "temperature": 0.5}, "temperature"),
    ({"input": "hi", "dimensions": 4}, "dimensions"),  # the tiny checkpoint is not Matryoshka
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({}, "input"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": [999999999]}, "input"),
    ({"messages": [{"role": "user", "content": [image_part("data:image/png;base64,AAAA")]}]}, "messages"),
])
def test_bad_bodies_are_400s_naming_the_field(server, engine, body, param):
    res = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body})
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    wait_until_idle(engine)


def test_generation_routes_on_a_pooling_server_and_embeddings_on_a_generation_server(server, qwen3_vl_dir):
    res = httpx.post(server.base_url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert res.status_code == 400 and "runner='generate'" in res.json()["error"]["message"]
    gen = tiny_engine(qwen3_vl_dir)
    srv = serve_in_thread(gen, ServerSettings(served_model_name=MODEL))
    try:
        res = httpx.post(srv.base_url + "/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert res.status_code == 400 and "--runner pooling" in res.json()["error"]["message"]
        assert res.json()["error"]["code"] == "wrong_runner"
    finally:
        srv.stop()
        gen.shutdown()


def test_run_batch_embedding_lines(qwen3_vl_dir: Path, tmp_path: Path, offline):
    lines = [{"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": TEXTS}},
             {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x",
                                                                                     "max_tokens": 3}}]
    src, out = _write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(qwen3_vl_dir), "--served-model-name",
                 "m", "--runner", "pooling", *ENGINE_FLAGS]) == 0
    answers = {o["custom_id"]: o for o in _outputs(out)}
    body = answers["e1"]["response"]["body"]
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, atol=1e-5)
    assert answers["e2"]["response"] is None  # vLLM's failed line: no response, the error beside it
    assert "max_tokens" in json.dumps(answers["e2"]["error"])
