"""The bundled default model (assets/model/vlmrun-shapes-qwen3_5): files, accuracy, HF parity, wiring.

- The checkpoint is a complete HF Qwen3.5 checkpoint of at most 20 MB.
- On 300 held-out scenes (split seed `EVAL_SEED`, never used in training), vlmrun with greedy
  decoding gets >= 90 % of captions exactly right, >= 90 % of JSON answers (`DESCRIBE_JSON_PROMPT`,
  the text of `scene_json`) and >= 90 % of questions (one per scene). All 900 requests go through one
  `LLM.generate` call (continuous batching), float32 on CPU, on the `LLM()` built without a model
  name (the default).
- Held to `SCENE_SCHEMA` by constrained decoding, the JSON prompt's objects equal the scenes' truth
  as often as the plain captions are right (the structured-outputs issue's aim), less one scene.
- HF transformers' greedy `generate` (float32) gives the same tokens as vlmrun: one request at a
  time through HF's own processor on the first PARITY_SCENES scenes (caption, JSON and question each),
  and batched on all 900 requests (with vlmrun's preprocessing, as the training script evaluates).
- `python -m pytest -q -s tests/test_default_model.py -k accuracy` prints the accuracy and every wrong answer.
- The generator scenes shipped in assets/images are captioned exactly, by `vlmrun caption` without
  --model (the README's main command) and by `vlmrun.generate` without a model.

The wiring that needs no weights (the error when the checkpoint is missing, each entry point's
fallback) is tested by tests/test_default_model_wiring.py with a stand-in checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import vlmrun
from testing.scene_drawing import render_scene
from testing.scene_splits import EVAL_SEED, eval_scenes
from training.evaluate import MAX_NEW_TOKENS, eval_requests, hf_greedy, score
from vlmrun import LLM, SamplingParams
from vlmrun.cli import main
from vlmrun.default_model import MODEL_DIR_NAME, default_model_path
from vlmrun.processors import Processor
from vlmrun.shape_scenes import DESCRIBE_JSON_PROMPT, DESCRIBE_PROMPT, SCENE_SCHEMA, scene_from_file, scene_objects

MODEL = default_model_path()
ASSET_IMAGES = Path(__file__).resolve().parents[1] / "assets" / "images"
N_SCENES = 300
PARITY_SCENES = 16
MIN_ACCURACY = 0.90
MAX_BYTES = 20 * 1024 * 1024


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _scene_assets() -> list[tuple[Path, str]]:
    """(file, the generator's caption of it) for each scene shipped in assets/images."""
    scenes = [(p, scene) for p in sorted(ASSET_IMAGES.iterdir()) if (scene := scene_from_file(p)) is not None]
    assert len(scenes) >= 3, "assets/images should hold a few generator scenes"
    out = []
    for path, scene in scenes:
        with Image.open(path) as image:
            assert image.size == (scene.width, scene.height)
        out.append((path, scene.caption))
    return out


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu")  # no model named: the bundled default


@pytest.fixture(scope="module")
def heldout(llm):
    requests = eval_requests(eval_scenes(N_SCENES, EVAL_SEED))
    images = {}
    for r in requests:
        if r.scene.index not in images:
            images[r.scene.index] = render_scene(r.scene)
    prompts = [{"prompt": r.prompt, "images": [images[r.scene.index]]} for r in requests]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    return requests, images, outs


def test_checkpoint_files():
    names = {p.name for p in MODEL.iterdir()}
    for required in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json", "README.md"):
        assert required in names, f"{MODEL} lacks {required}"
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert set(config["text_config"]["layer_types"]) == {"linear_attention", "full_attention"}
    size = sum(p.stat().st_size for p in MODEL.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"the default model takes {size / 2**20:.1f} MiB on disk (limit 20)"
    card = (MODEL / "README.md").read_text()
    assert f"python -m training.train_default_model --out assets/model/{MODEL_DIR_NAME}" in card


def test_llm_without_model_runs_the_default(llm):
    assert llm.engine.model_config.path == MODEL
    assert llm.engine.model_config.architecture == "Qwen3_5ForConditionalGeneration"


def test_heldout_accuracy(heldout):
    requests, _, outs = heldout
    errors = [o.error for o in outs if o.error is not None]
    assert not errors, errors[:3]
    assert all(o.finish_reason == "stop" for o in outs), "every answer should end with <|im_end|>"
    metrics = score(requests, [o.text for o in outs])
    wrong = [(r.prompt, r.reference, o.text) for r, o in zip(requests, outs) if o.text.strip() != r.reference]
    print(f"\nheld-out accuracy through vlmrun ({N_SCENES} scenes): {metrics}")  # shown with pytest -s
    for prompt, reference, answer in wrong:
        print(f"  {prompt!r}: expected {reference!r}, got {answer!r}")
    assert metrics["caption"] >= MIN_ACCURACY, (metrics, wrong[:5])
    assert metrics["json"] >= MIN_ACCURACY, (metrics, wrong[:5])
    assert metrics["question"] >= MIN_ACCURACY, (metrics, wrong[:5])


def test_schema_constrained_objects_describe_the_scenes(llm, heldout):
    """The JSON prompt held to SCENE_SCHEMA: every answer parses, and its object is the scene's truth as
    often as the plain caption is exactly right (one scene of slack)."""
    requests, images, outs = heldout
    scenes = {r.scene.index: r.scene for r in requests}
    prompts = [{"prompt": DESCRIBE_JSON_PROMPT, "images": [images[i]]} for i in scenes]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, structured_outputs={"json": SCENE_SCHEMA})
    constrained = llm.generate(prompts, params, use_tqdm=False)
    objects = [json.loads(o.text) for o in constrained]  # constrained: every answer parses
    right = sum(obj == scene_objects(scene) for obj, scene in zip(objects, scenes.values()))
    captions = sum(o.text.strip() == r.reference for r, o in zip(requests, outs) if r.kind == "caption")
    print(f"\nschema-constrained objects right: {right}/{len(scenes)}; plain captions right: {captions}/{len(scenes)}")
    assert right >= captions - 1


def test_hf_greedy_is_token_identical(heldout):
    from testing.hf_reference import HFReference

    requests, images, outs = heldout
    hf = HFReference(MODEL)
    stops = set(hf.model.generation_config.eos_token_id)
    for r, out in [(r, o) for r, o in zip(requests, outs) if r.scene.index < PARITY_SCENES]:
        messages = [{"role": "user", "content": [{"type": "image", "image": images[r.scene.index]},
                                                 {"type": "text", "text": r.prompt}]}]
        ref = hf.generate(messages, MAX_NEW_TOKENS)
        assert out.prompt_token_ids == ref.prompt_ids, f"scene {r.scene.index} {r.prompt!r}: prompt ids differ"
        ours = [t for t in out.token_ids if t not in stops]
        theirs = [t for t in ref.token_ids if t not in stops]
        assert ours == theirs, f"scene {r.scene.index} {r.prompt!r}: vlmrun {out.text!r} vs HF {hf.tokenizer.decode(theirs)!r}"


def test_hf_batched_greedy_matches_on_every_scene(heldout):
    """All 900 held-out requests: HF generate (batched, left-padded, vlmrun's preprocessing) gives vlmrun's tokens."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    requests, _, outs = heldout
    model = Qwen3_5ForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    theirs = hf_greedy(model, Processor.from_pretrained(MODEL), requests)
    stops = set(model.generation_config.eos_token_id)
    ours = [[t for t in out.token_ids if t not in stops] for out in outs]
    differ = [r.prompt for r, a, b in zip(requests, ours, theirs) if a != b]
    assert not differ, f"{len(differ)} of {len(requests)} requests differ, e.g. {differ[:3]}"


def test_readme_main_command_captions_the_scene_assets(capsys):
    """`vlmrun caption assets/images` (no --model): exact captions for the scenes, a caption for every photo."""
    assert main(["caption", str(ASSET_IMAGES), "--no-progress", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # stdout is no terminal: JSONL
    printed = {r["image"]: r["caption"] for r in records}
    for path, caption in _scene_assets():
        assert printed[str(path)] == caption, path.name
    photos = [p for p in ASSET_IMAGES.iterdir() if p.suffix in (".jpg", ".png") and scene_from_file(p) is None]
    assert all(printed[str(p)] for p in photos)


def test_generate_without_model():
    path, caption = _scene_assets()[0]
    assert vlmrun.generate(images=[str(path)], device="cpu", dtype="float32") == caption


def test_web_examples_ask_what_the_scene_answers(llm):
    """The web demo's examples for this model: scenes with a question each one answers, answered right."""
    from vlmrun.web.app import examples

    shown = examples(MODEL_DIR_NAME, ASSET_IMAGES)
    references = []
    for example in shown:
        scene = scene_from_file(example["files"][0])
        answers = {qa.question: qa.answer for qa in scene.qa_pairs()} | {DESCRIBE_PROMPT: scene.caption}
        references.append(answers[example["text"]])
    assert len({e["text"] for e in shown}) >= 4  # captions and several question kinds
    outs = llm.generate([{"prompt": e["text"], "images": e["files"]} for e in shown], _params(), use_tqdm=False)
    assert [o.text.strip() for o in outs] == references
