"""The bundled default model: where it lives, and the model a command uses when none is named.

`assets/model/vlmrun-shapes-qwen3_5/` holds a tiny Qwen3.5-architecture checkpoint
(`Qwen3_5ForConditionalGeneration`, HF format, float32) trained from scratch on the synthetic
scenes of `vlmrun.shape_scenes` (which also holds the prompts it was trained on): it captions and
answers questions about coloured shapes, nothing else. `training/train_default_model.py` rebuilds
it from one command. This module only resolves paths, so the engine can import it cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

MODEL_DIR_NAME = "vlmrun-shapes-qwen3_5"


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
