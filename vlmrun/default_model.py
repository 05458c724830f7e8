"""The bundled default model: where it lives and the prompts it was trained on.

`assets/model/vlmrun-shapes-qwen3_5/` holds a tiny Qwen3.5-architecture checkpoint
(`Qwen3_5ForConditionalGeneration`, HF format, float32) trained from scratch on the synthetic
scenes of `vlmrun.synthetic`: it captions and answers questions about coloured shapes, nothing
else. `training/train_default_model.py` rebuilds it from one command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from vlmrun.synthetic import COUNT_QUESTION, DESCRIBE_PROMPT

MODEL_DIR_NAME = "vlmrun-shapes-qwen3_5"

# The caption prompt (also vlmrun.generate's default prompt).
CAPTION_PROMPT = DESCRIBE_PROMPT

# Question templates the model was trained on; {where} is "on the left", "in the middle" or "on the
# right" (also the answers to "Where ..."), {colour} one of vlmrun.synthetic.COLOURS, {shape} one of SHAPES.
QUESTION_TEMPLATES: tuple[str, ...] = (
    COUNT_QUESTION,
    "What colour is the shape {where}?",
    "What shape is {where}?",
    "Where is the {colour} {shape}?",
)

# A few concrete prompts; they are part of the tokenizer's training text (training/checkpoint_files.py),
# so changing them changes the shipped tokenizer.
PROMPTS: tuple[str, ...] = (
    CAPTION_PROMPT,
    COUNT_QUESTION,
    "What colour is the shape on the left?",
    "What colour is the shape in the middle?",
    "Where is the red square?",
    "Where is the blue circle?",
)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_model_path() -> Path:
    """The shipped checkpoint directory (an HF checkpoint: config.json, safetensors, tokenizer, ...)."""
    return repo_root() / "assets" / "model" / MODEL_DIR_NAME


def resolve_model(model: Optional[str]) -> str:
    """`model` itself, or the bundled checkpoint's directory when no model is named (None or "")."""
    if model:
        return model
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model given and the bundled default model is missing from {path}; "
                                "pass a checkpoint directory or hub id (model=... / --model)")
    return str(path)


def served_name(model: Optional[str]) -> str:
    """The id a server lists for `model`: the name given, or the bundled model's name."""
    return model or MODEL_DIR_NAME
