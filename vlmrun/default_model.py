"""The bundled default model: where it lives and the prompts it was trained on.

`assets/model/vlmrun-shapes-qwen3_5/` holds a tiny Qwen3.5-architecture checkpoint
(`Qwen3_5ForConditionalGeneration`, HF format, float32) trained from scratch on the synthetic
scenes of `vlmrun.synthetic`: it captions and answers questions about coloured shapes, nothing
else. `training/train_default_model.py` rebuilds it from one command.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.synthetic import COUNT_QUESTION, DESCRIBE_PROMPT, SLOT_PHRASES

MODEL_DIR_NAME = "vlmrun-shapes-qwen3_5"

# The caption prompt (also vlmrun.generate's default prompt).
CAPTION_PROMPT = DESCRIBE_PROMPT

# Question templates the model was trained on; {shape} is one of SHAPES, {colour} one of
# vlmrun.synthetic.COLOURS, {where} one of "on the left", "in the middle", "on the right".
QUESTION_TEMPLATES: tuple[str, ...] = (
    COUNT_QUESTION,
    "What colour is the {shape}?",
    "What size is the {shape}?",
    "What shape is {where}?",
    "Where is the {colour} {shape}?",
)

# A few concrete prompts, e.g. for the web demo's examples.
PROMPTS: tuple[str, ...] = (
    CAPTION_PROMPT,
    COUNT_QUESTION,
    *(f"What shape is {where}?" for where in SLOT_PHRASES.values()),
    "What colour is the circle?",
    "Where is the red square?",
)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_model_path() -> Path:
    """The shipped checkpoint directory (an HF checkpoint: config.json, safetensors, tokenizer, ...)."""
    return repo_root() / "assets" / "model" / MODEL_DIR_NAME
