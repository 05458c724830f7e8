"""LoRA adapters over HTTP and on the command line.

The server (`--enable-lora --lora-modules name=path`) serves two adapters and the base model to the
`openai` client at once: each answer equals HF + PEFT's greedy tokens for its adapter (the base
model's for the served name), /v1/models lists the adapters with the model as parent, an unknown name
is a 404. `vlmrun caption --lora PATH` captions with the adapter (the captions of `LLM.generate` with it).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from testing.image_folders import write_images
from tests.server_fixtures import MODEL, served_fixtures
from tests.test_lora import MAX_NEW, lora_setup
from vlmrun.server.cli import lora_modules

ADAPTERS = ("all", "rs_regex")


@pytest.fixture(scope="module")
def setup(request):
    return lora_setup(request, "qwen3_vl")


def adapted_checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("setup").model_dir


def served_adapters(request: pytest.FixtureRequest) -> dict:
    adapters = request.getfixturevalue("setup").adapters
    return {"lora_modules": {n: str(adapters[n]) for n in ADAPTERS}}


engine, server, client = served_fixtures(adapted_checkpoint, settings=served_adapters, enable_lora=True, max_loras=2,
                                         max_lora_rank=8)


def test_models_lists_the_adapters(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, *ADAPTERS]
    assert all(cards[n].model_extra["parent"] == MODEL for n in ADAPTERS)
    assert client.models.retrieve("all").model_extra["parent"] == MODEL


def test_two_adapters_and_the_base_at_once(client, setup):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    text = setup.cases["text"][0]["content"][0]["text"]

    def ask(model: str):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                              temperature=0, max_tokens=MAX_NEW, logprobs=True)

    names = [MODEL, *ADAPTERS] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(ask, names))
    for name, answer in zip(names, answers):
        expected = setup.expected[("base" if name == MODEL else name, "text")]
        assert answer.model == name
        got = [t.token for t in answer.choices[0].logprobs.content]
        assert got == [tokenizer.decode([t]) for t in expected.token_ids], name


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_lora_modules_flag(setup):
    x, y = str(setup.adapters["all"]), str(setup.adapters["rs_regex"])  # each read and checked at start-up
    args = argparse.Namespace(lora_modules=[f"a={x}", json.dumps({"name": "b", "path": y})], enable_lora=True)
    assert lora_modules(args) == {"a": x, "b": y}
    for bad in (["a"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            lora_modules(argparse.Namespace(lora_modules=bad, enable_lora=True))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_modules(argparse.Namespace(lora_modules=["a=/x"], enable_lora=False))


def test_caption_with_lora(setup, tmp_path: Path):
    from vlmrun import LLM, LoRARequest, SamplingParams
    from vlmrun.cli import main

    paths = write_images(tmp_path / "imgs", 2)
    adapter = setup.adapters["vision"]
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(tmp_path / "imgs"), "--out", str(out), "--model", str(setup.model_dir), "--dtype",
                 "float32", "--device", "cpu", "--max-tokens", "6", "--lora", str(adapter), "--no-progress"]) == 0
    got = {r["image"]: r["caption"] for r in map(json.loads, out.read_text().splitlines())}
    llm = LLM(str(setup.model_dir), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6)
    with_lora = llm.generate([{"prompt": "Describe the image.", "images": [str(p)]} for p in paths], params,
                             use_tqdm=False, lora_request=LoRARequest("vision", 1, str(adapter)))
    base = llm.generate([{"prompt": "Describe the image.", "images": [str(p)]} for p in paths], params, use_tqdm=False)
    assert got == {str(p): o.text for p, o in zip(paths, with_lora)}
    assert got != {str(p): o.text for p, o in zip(paths, base)}
