"""The model card (README.md) of the default checkpoint, filled in from the training results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.data import KIND_WEIGHTS
from vlmrun.default_model import MODEL_DIR_NAME
from vlmrun.shape_scenes import (COLOURS, DESCRIBE_JSON_PROMPT, LARGE_EXTENT, QUESTION_TEMPLATES, SCENE_SCHEMA, SHAPES,
                                 SMALL_EXTENT)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _mtp_training(results: dict[str, Any]) -> str:
    """Stage three's paragraph (empty for a checkpoint without the MTP layer)."""
    m = results.get("mtp_stage")
    if m is None:
        return ""
    r = m["recipe"]
    questions_pct = 100 - round(100 * r["caption_fraction"]) - round(100 * r["json_fraction"])
    return f"""
Stage three (`python -m training.train_mtp --out assets/model/{MODEL_DIR_NAME}`, from the stage-two
checkpoint; `training/train_mtp.py`): the MTP layer, on the training scenes {r['first_scene']:,} onwards with
the stage-two weights frozen (they run without gradients and stay byte for byte as they were:
`model.safetensors` is unchanged, the layer lies in `model-mtp.safetensors`). {round(100 * r['caption_fraction'])} % captions,
{round(100 * r['json_fraction'])} % JSON objects, {questions_pct} % questions; AdamW (lr {r['lr']}, {r['warmup']} warm-up steps then cosine to {r['min_lr_ratio']} x,
weight decay {r['weight_decay']}), batch {r['batch_size']}, {r['steps']:,} steps, seed {r['seed']}; the loss is the cross-entropy of draft
steps 1 .. {r['depth']} over the answer tokens, weighted 1, 1/2, ... It took {m['minutes']} min on one thread
({m['cpu']}, torch {m['torch']}), plus {m['eval_minutes']} min for the held-out evaluation and {m['vlmrun_minutes']} min
measuring it in vlmrun. Deterministic as the other stages (fixed seed, one compute thread, the data in
a fixed order); it keeps no snapshots: an interrupted run starts again.
"""


def _mtp_section(results: dict[str, Any]) -> str:
    """The speculative-decoding section: the layer's held-out accuracy and acceptance, predicted and measured."""
    m = results.get("mtp_stage")
    if m is None:
        return ""
    h = m["heldout"]
    top1 = ", ".join(f"draft {i + 1} {100 * x:.2f} %" for i, x in enumerate(h["top1"]))
    rows = []
    for k, by_kind in m["acceptance"].items():
        for kind in ("caption", "json", "question", "all"):
            if kind in by_kind:
                p, x = by_kind[kind]["predicted"], by_kind[kind]["measured"]
                rows.append(f"| {k} | {kind} | {x['mean_accepted_length']:.2f} | {_pct(x['acceptance_rate'])} "
                            f"| {x['accepted_tokens']:,} of {x['draft_tokens']:,} | {p['mean_accepted_length']:.2f} "
                            f"| {_pct(p['acceptance_rate'])} |")
    table = "\n".join(rows)
    same = "; ".join(f"k = {k}: {by_kind['same_tokens_as_hf']}" for k, by_kind in m["acceptance"].items())
    return f"""
## Speculative decoding (MTP layer)

The checkpoint carries one multi-token-prediction layer (`mtp_num_hidden_layers: 1`, weights under
`mtp.` as in the released Qwen3.5 checkpoints; HF transformers ignores them, vlmrun drafts with them):

```bash
vlmrun caption IMAGES --speculative-config '{{"method": "mtp", "num_speculative_tokens": 3}}'
```

On {h['requests']} held-out requests (a caption, a JSON object and a question on each of {h['scenes']} scenes of
split seed {h['split_seed']}), against the model's own greedy answers, the layer's top-1 accuracy is
{top1}
(draft s counted where the drafts before it were right; drafts past {m['recipe']['depth']} were not trained for: the
layer simply runs once more on its own output). Replaying vlmrun's greedy verify loop over those
hits predicts its counters; vlmrun itself (float32, CPU,
`{{"method": "mtp", "num_speculative_tokens": k}}`) measured:

| k | requests | mean accepted length | acceptance | accepted drafts | predicted length | predicted acceptance |
| --- | --- | --- | --- | --- | --- | --- |
{table}

The drafts a step makes past the answer's end (`<|im_end|>`) are never accepted, so acceptance stays
below the top-1 accuracy, the more so the shorter the answer (a question's is one word).
Speculation changes no token: vlmrun's answers equal HF transformers' greedy ones ({same}).
"""


def write_model_card(out: Path, results: dict[str, Any]) -> None:
    r, j, s, h = results["recipe"], results["json_stage"], results["size"], results["heldout"]
    kinds = "\n".join(f"| {k.split('/', 1)[1]} | {_pct(v)} |" for k, v in h.items() if k.startswith("question/"))
    questions = "\n".join(f"- `{q}`" for q in QUESTION_TEMPLATES)
    caption_pct = round(100 * r["caption_fraction"])
    weights = ", ".join(f"{k} {w:g}" for k, w in KIND_WEIGHTS.items())
    item = SCENE_SCHEMA["properties"]["shapes"]["items"]["properties"]
    fields = ", ".join(f"`{name}` one of {', '.join(spec['enum'])}" for name, spec in item.items())
    json_pct, json_caption_pct = round(100 * j["json_fraction"]), round(100 * j["caption_fraction"])
    text = f"""\
# {MODEL_DIR_NAME}

The default model bundled with vlmrun: a **tiny Qwen3.5-architecture vision-language model**
(`Qwen3_5ForConditionalGeneration`, {results['parameters'] / 1e6:.2f} M parameters, float32) trained from scratch on
synthetic pictures of coloured shapes. It sees shapes, not photographs: on a real photo it still
answers with shapes, because that is all it has ever seen.

## What it was trained on

Scenes from `vlmrun/shape_scenes.py` (drawn by `testing/scene_drawing.py`): 1-3 shapes ({', '.join(SHAPES)}) in {len(COLOURS)} colours
({', '.join(COLOURS)}) and two sizes (small: {SMALL_EXTENT[0]}-{SMALL_EXTENT[1]} px, large: {LARGE_EXTENT[0]}-{LARGE_EXTENT[1]} px across), each in its own third of the
picture (left, middle, right), on plain or lightly textured backgrounds (white, light grey, cream,
pale blue, dark grey; flat, noise, gradient or faint stripes), images of 64-256 px per side with
varied aspect ratios and at most 36 864 pixels. Each scene has a canonical caption, listing the
shapes left to right:

    a small red circle on the left, a large blue square in the middle and a small green triangle on the right

its JSON object (`vlmrun.shape_scenes.SCENE_SCHEMA`: a list `shapes` of 1-3 objects, left to right, {fields}):

    {{"shapes": [{{"colour": "red", "shape": "circle", "position": "left"}}, {{"colour": "blue", "shape": "square", "position": "middle"}}]}}

and questions, each with one correct answer. The prompts it knows (one user turn with one image):

- `Describe the image.` (the caption)
- `{DESCRIBE_JSON_PROMPT}` (the JSON object, on one line, keys in the schema's order)
{questions}

The scene complexity was chosen so that a 3 M-parameter model reaches >= 90 % within a 60-minute CPU
budget: three shape kinds, five well-separated colours, two clearly different sizes, at most one
shape per third of the picture (no overlaps), and four question kinds (count; the colour and the kind
of the shape in a given third; the third of a shape named by colour and kind). Even a small shape
spans about one merged vision token (32 x 32 px) or more: with the smallest shapes at 20-26 px the
tower learned the kinds far more slowly, and captions stayed below 70 % in the same budget.

Training examples are {caption_pct} % captions and {100 - caption_pct} % questions (question kind drawn with weights
{weights}), one fresh scene each, {r['steps'] * r['batch_size']:,} scenes in all. The language-model loss is the mean
cross-entropy over the answer tokens only. While training, a linear probe on the merged vision tokens (the embeddings the language model
receives) also predicts, per 32 x 32 cell, the kind, colour and size of the shape covering it and
which third of the picture it belongs to. Without that dense signal a model this small sits for
thousands of steps on the "blind" plateau where it answers from the text alone. A second probe reads
the hidden state of a question's last word ("circle" in "Where is the red circle?") after the first
full-attention layer and predicts the kind, colour and third of the shape the question names: learned
from the answer token alone, finding the named shape stayed at chance for 4,000 steps. Both probes
(`training/aux_targets.py`, weight {r['aux_weight']}) are dropped: the checkpoint is a plain Qwen3.5.

A second stage taught it the JSON prompt: {j['steps']:,} more steps on the {j['steps'] * j['batch_size']:,} training scenes after those
of stage one, {json_pct} % JSON answers, {json_caption_pct} % captions and {100 - json_pct - json_caption_pct} % questions (so it forgets neither), no probes.

## Architecture

- Vision: Qwen3.5 vision tower, patch 16, spatial merge 2 (one merged token per 32 x 32 pixels), depth
  {s['vision_depth']}, hidden {s['vision_hidden']}, {s['vision_heads']} heads, MLP {s['vision_intermediate']}, a {s['vision_pos_grid']} x {s['vision_pos_grid']} learned position grid.
  Preprocessing: sides rounded to multiples of 32, {s['min_merged_tokens']}-{s['max_merged_tokens']} merged tokens per image (`max_pixels` = {s['max_merged_tokens'] * 1024}).
- Text: hybrid Qwen3.5 stack of {len(s['text_layers'])} layers, `layer_types` = {list(s['text_layers'])},
  hidden {s['text_hidden']}, MLP {s['text_intermediate']}; full attention {s['attn_heads']} query / {s['attn_kv_heads']} KV heads of {s['attn_head_dim']}
  (M-RoPE on a quarter of each head, interleaved); Gated DeltaNet {s['gdn_key_heads']} key / {s['gdn_value_heads']} value heads of {s['gdn_head_dim']}, conv kernel 4.
- Tokenizer: byte-level BPE trained on the scenes' text (each word one token, any text still encodes),
  the Qwen special tokens, a ChatML chat template. Untied embeddings.

## Training

```bash
python -m training.train_default_model --out assets/model/{MODEL_DIR_NAME}
```

Stage one:

HF transformers' own Qwen3.5 classes on CPU, float32, AdamW (lr {r['lr']}, betas 0.9/0.98, weight decay
{r['weight_decay']}, {r['warmup']} warm-up steps then cosine to {r['min_lr_ratio']} x), batch {r['batch_size']}, {r['steps']} steps, gradient
clipping {r['grad_clip']}, seed {r['seed']}; deterministic data order (step s trains on training scenes
s*{r['batch_size']} .. s*{r['batch_size']}+{r['batch_size'] - 1}). One compute thread plus one process that renders
the next batches; two exact speed-ups while training (the patch-embedding Conv3d as the equal matrix
product, Gated DeltaNet chunks of 32 instead of 64: `training/fast_ops.py`). It took
{results['train_minutes']} min on 2 CPU cores (torch {results['torch']}).

Stage two (`JSON_STAGE`; `--from DIR` runs it alone from a stage-one checkpoint): a fresh AdamW (lr
{j['lr']}, {j['warmup']} warm-up steps then cosine to {j['min_lr_ratio']} x, the rest as stage one), batch {j['batch_size']}, {j['steps']:,} steps,
training scenes {j['first_scene']:,} onwards. It took {results['json_minutes']} min (torch {results['json_torch']}), plus
{results['eval_minutes']} min for the held-out evaluation.
{_mtp_training(results)}
Stages one and two are deterministic (fixed seeds, one compute thread, no randomness after init): a rerun of
stage one with the same torch build on the same CPU type gave bit-identical weights (stage two was
not re-run to check). An interrupted run picks up from its last snapshot when started again.

## Accuracy

{h['scenes']} held-out scenes (split seed {h['split_seed']}, never used in training), greedy decoding, exact match
after stripping whitespace; one caption, one JSON object and one question per scene ({h['decoder']}; the
vlmrun test `tests/test_default_model.py` checks the same through vlmrun, and the JSON held to
`SCENE_SCHEMA` by constrained decoding):

| | accuracy |
| --- | --- |
| captions (exact match) | {_pct(h['caption'])} |
| JSON objects (exact text) | {_pct(h['json'])} |
| questions | {_pct(h['question'])} |
{kinds}
{_mtp_section(results)}
## Limits

Only these scenes: shapes outside the three kinds, colours outside the five, more than three
shapes, overlapping shapes, or any photograph get a confident shape caption that is simply wrong.
For real images run a real checkpoint, e.g. `vlmrun caption IMAGES --model Qwen/Qwen3-VL-2B-Instruct`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")
