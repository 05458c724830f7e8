"""A bad LoRA adapter fails its own requests with an error naming it; the engine keeps serving.

Missing files, an adapter for other base shapes, a rank over `max_lora_rank`, `modules_to_save`,
a module the model does not have, an id reused for another adapter, LoRA on an engine started
without it. The good requests of the same call complete with their own adapter's tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from testing.lora_adapters import build_peft_adapter, peft_reference
from tests.test_engine_parity import assert_matches, user
from tests.test_lora import MAX_NEW, params
from vlmrun import LLM, LoRARequest

MSGS = [user("Name three colours.")]


@pytest.fixture(scope="module")
def good(qwen3_dir, tmp_path_factory) -> tuple[Path, object]:
    """A rank-8 adapter on q_proj / v_proj and HF + PEFT's tokens for MSGS."""
    folder = build_peft_adapter(qwen3_dir, tmp_path_factory.mktemp("lora_good") / "a", target_modules=["q_proj", "v_proj"],
                                r=8, lora_alpha=16, seed=5)
    return folder, peft_reference(qwen3_dir, folder).generate(MSGS, MAX_NEW)


def variant(good_dir: Path, tmp: Path, name: str, *, config=None, tensors=None) -> Path:
    """A copy of the good adapter with its config and/or tensors edited."""
    out = tmp / name
    shutil.copytree(good_dir, out)
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        config(cfg)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        sd = load_file(str(out / "adapter_model.safetensors"))
        tensors(sd)
        save_file(sd, str(out / "adapter_model.safetensors"))
    return out


def first_key(sd: dict, part: str) -> str:
    return next(k for k in sorted(sd) if part in k)


def assert_bad_fail_alone(qwen3_dir: Path, good: tuple[Path, object], bad: dict[str, tuple[Path, str]]
                          ) -> tuple[LLM, LoRARequest]:
    """One call: the good adapter, each bad one ({name: (folder, words its error names)}), the good one
    again; the good answers equal the reference, each bad one fails alone naming itself and the words.
    Returns the engine and the good adapter's request."""
    good_dir, expected = good
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["good", *bad, "good"]
    requests = [LoRARequest(n, i + 1, str(good_dir if n == "good" else bad[n][0])) for i, n in enumerate(names)]
    requests[-1] = requests[0]
    outs = llm.chat([MSGS] * len(names), params(), use_tqdm=False, lora_request=requests)
    for name, out in zip(names, outs):
        if name == "good":
            assert_matches(out, expected, name)
        else:
            assert out.error is not None and repr(name) in out.error and bad[name][1] in out.error, (name, out.error)
    return llm, requests[0]


def test_bad_adapters_fail_alone(qwen3_dir, good, tmp_path):
    good_dir, expected = good
    bad = {
        "missing": (tmp_path / "nowhere", "does not exist"),
        "modules_to_save": (variant(good_dir, tmp_path, "mts", config=lambda c: c.update(modules_to_save=["lm_head"])),
                            "modules_to_save"),
        "dora": (variant(good_dir, tmp_path, "dora", config=lambda c: c.update(use_dora=True)), "DoRA"),
        "shapes": (variant(good_dir, tmp_path, "shapes", tensors=lambda sd: sd.update(
            {first_key(sd, "lora_B"): sd[first_key(sd, "lora_B")][:-1]})), "do not fit the base layer"),
        "no_module": (variant(good_dir, tmp_path, "no_module", tensors=lambda sd: sd.update(
            {"base_model.model.model.layers.0.self_attn.nope_proj.lora_A.weight": sd[first_key(sd, "lora_A")].clone(),
             "base_model.model.model.layers.0.self_attn.nope_proj.lora_B.weight": sd[first_key(sd, "lora_B")].clone()})),
                      "no linear layer of this model"),
        "embedding": (variant(good_dir, tmp_path, "emb", tensors=lambda sd: sd.update(
            {"base_model.model.model.embed_tokens.lora_embedding_A": sd[first_key(sd, "lora_A")].clone()})), "embeddings"),
    }
    llm, good_request = assert_bad_fail_alone(qwen3_dir, good, bad)
    assert_matches(llm.chat(MSGS, params(), use_tqdm=False, lora_request=good_request)[0], expected, "after")


def test_rank_over_the_limit(qwen3_dir, good):
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=4)
    out = llm.chat(MSGS, params(), use_tqdm=False, lora_request=LoRARequest("big", 1, str(good[0])))[0]
    assert "'big'" in out.error and "rank 8 is over max_lora_rank=4" in out.error


def test_id_reused_for_another_adapter(qwen3_dir, good, tmp_path):
    other = variant(good[0], tmp_path, "other")
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True)
    first, second = llm.chat([MSGS, MSGS], params(), use_tqdm=False,
                             lora_request=[LoRARequest("a", 1, str(good[0])), LoRARequest("b", 1, str(other))])
    assert_matches(first, good[1], "a")
    assert "'b'" in second.error and "lora_int_id 1 is already adapter 'a'" in second.error


def test_lora_needs_enable_lora(qwen3_dir, good):
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu")
    out = llm.chat(MSGS, params(), use_tqdm=False, lora_request=LoRARequest("a", 1, str(good[0])))[0]
    assert "'a'" in out.error and "enable_lora" in out.error


def test_lora_request_as_a_vllm_script_writes_it():
    """vLLM's LoRARequest: (name, id, path) by position or by vLLM's keywords, read back by the fields or
    by vLLM's read-only names (`adapter_id`, `name`, `path`); base_model_name does not tell adapters apart."""
    by_position = LoRARequest("sql", 7, "/adapters/sql")
    by_keyword = LoRARequest(lora_name="sql", lora_int_id=7, lora_path="/adapters/sql", base_model_name="base")
    assert by_position == by_keyword and hash(by_position) == hash(by_keyword)
    for r in (by_position, by_keyword):
        assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 7, "/adapters/sql")
        assert (r.name, r.adapter_id, r.path) == (r.lora_name, r.lora_int_id, r.lora_path)
    assert by_position != LoRARequest("sql", 8, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path is empty"):
        LoRARequest("a", 1, "")


def test_a_step_never_reads_an_adapter_from_disk(qwen3_dir, good, tmp_path):
    """An adapter is read when its request is added; its host copy is kept until a step has put it in
    a slot, past max_cpu_loras, so the folders can go once the requests are in (three adapters, one
    slot, one host copy allowed)."""
    good_dir, expected = good
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    prompt = engine.process({"prompt": "Name three colours.", "images": []})
    for i, name in enumerate("abc"):
        folder = shutil.copytree(good_dir, tmp_path / name)
        engine.add_request(name, prompt, params(), LoRARequest(name, i + 1, str(folder)))
        shutil.rmtree(folder)
    results = {}
    while engine.has_unfinished():
        results.update((u.request_id, u.result) for u in engine.step() if u.finished)
    assert {name: r.token_ids for name, r in results.items()} == {name: expected.token_ids for name in "abc"}
