"""The bundled default model's MTP layer (stage three, `training/train_mtp.py`) drafts in vlmrun.

- The checkpoint announces one MTP layer (`mtp_num_hidden_layers: 1`); its `mtp.*` tensors lie in
  their own shard, listed with the main weights in the shard index, and `model.safetensors` holds none.
- On held-out scenes (the caption prompt, greedy), vlmrun with
  `{"method": "mtp", "num_speculative_tokens": 2}` gives exactly plain decoding's tokens, accepts most
  drafts, and its counters are the ones the training stage's evaluation predicts from the same layer
  run with transformers' modules over the model's greedy answers (`training.mtp_eval`): a draft is
  accepted in vlmrun when, and only when, the layer as trained gets that token right.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

from testing.scene_drawing import render_scene
from testing.scene_splits import EVAL_SEED, eval_scenes
from training.evaluate import MAX_NEW_TOKENS, eval_requests
from training.mtp_eval import Counters, draft_hits, greedy_sequences, predicted
from training.mtp_head import FrozenModel, load_mtp_head
from vlmrun import LLM, SamplingParams
from vlmrun.default_model import default_model_path
from vlmrun.processors import Processor

MODEL = default_model_path()
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
SCENES = 4


def test_checkpoint_carries_one_mtp_layer_in_its_own_shard():
    config = json.loads((MODEL / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    weight_map = json.loads((MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = {name for name in weight_map if name.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= mtp
    assert {weight_map[name] for name in mtp} == {"model-mtp.safetensors"}
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        main = set(f.keys())
    assert main and not any(name.startswith("mtp.") for name in main)
    assert main == {name for name, shard in weight_map.items() if shard == "model.safetensors"}


@pytest.fixture(scope="module")
def requests():
    return [r for r in eval_requests(eval_scenes(SCENES, EVAL_SEED)) if r.kind == "caption"]


def _generate(requests, speculative_config):
    llm = LLM(dtype="float32", device="cpu", speculative_config=speculative_config)
    try:
        prompts = [{"prompt": r.prompt, "images": [render_scene(r.scene)]} for r in requests]
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_mtp_drafts_are_accepted_as_the_training_evaluation_predicts(requests, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # transformers' torch GDN path on CPU tensors
    plain = _generate(requests, None)
    spec = _generate(requests, SPEC)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    measured = Counters()
    for o in spec:
        s = o.metrics.spec_decode
        measured = measured.add(Counters(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens))
    assert measured.num_draft_tokens > 30
    assert measured.num_accepted_tokens / measured.num_draft_tokens > 0.6, measured

    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(MODEL), dtype=torch.float32)
    processor = Processor.from_pretrained(MODEL)
    tok = processor.tokenizer
    pad, image = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")
    frozen = FrozenModel(model)
    seqs = greedy_sequences(model, processor, requests)
    assert [s.answer_ids for s in seqs] == [list(o.token_ids) for o in plain]  # HF's greedy answers are vlmrun's
    hits, _ = draft_hits(frozen, load_mtp_head(MODEL, model.config), seqs, 2, pad, image)
    expected = predicted(seqs, hits, SPEC["num_speculative_tokens"])["all"]
    assert measured.num_drafts == pytest.approx(expected.num_drafts, abs=1)
    assert measured.num_accepted_tokens == pytest.approx(expected.num_accepted_tokens, abs=2), (measured, expected)


def test_mtp_stage_end_to_end(tmp_path):
    """`training.train_mtp` for two steps from the bundled checkpoint: the main files unchanged, the layer
    and its figures written, and vlmrun's counters on the held-out requests equal to the prediction."""
    import subprocess

    out = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-m", "training.train_mtp", "--from", str(MODEL), "--out", str(out),
                          "--steps", "2", "--log-every", "1", "--eval-scenes", "1", "--measure-k", "2"],
                         cwd=MODEL.parents[2], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for name in ("model.safetensors", "tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (MODEL / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    stage = json.loads((out / "training_results.json").read_text())["mtp_stage"]
    assert stage["recipe"]["steps"] == 2 and [h["step"] for h in stage["loss_history"]] == [1, 2]
    measured, expected = stage["acceptance"]["2"]["all"]["measured"], stage["acceptance"]["2"]["all"]["predicted"]
    assert measured["verify_steps"] == pytest.approx(expected["verify_steps"], abs=1)
    assert measured["accepted_tokens"] == pytest.approx(expected["accepted_tokens"], abs=2), (measured, expected)
    assert stage["acceptance"]["2"]["same_tokens_as_hf"] == "3 of 3"
    assert "## Speculative decoding (MTP layer)" in (out / "README.md").read_text()
