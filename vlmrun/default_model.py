"""The bundled default model: where it lives, and the model a command uses when none is named.

`assets/model/vlmrun-shapes-qwen3_5/` holds a tiny Qwen3.5-architecture checkpoint
(`Qwen3_5ForConditionalGeneration`, HF format, float32) trained from scratch on the synthetic
scenes of `vlmrun.shape_scenes` (which also holds the prompts it was trained on): it captions and
answers questions about coloured shapes, nothing else. `training/train_default_model.py` rebuilds
it from one command. This module only resolves paths, so the engine can import it cheaply.

Running it because no model was named is said once, on stderr (a logging warning, `BUNDLED_MODEL_NOTICE`),
where the model is resolved for the run: a photo gets a confident shape caption, and the user should
know why and how to name a real model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

MODEL_DIR_NAME = "vlmrun-shapes-qwen3_5"
REAL_MODEL_EXAMPLE = "Qwen/Qwen3-VL-2B-Instruct"
BUNDLED_MODEL_NOTICE = (
    "vlmrun: no model named, so this runs the bundled 3M-parameter shapes model ({path}): it only knows "
    "coloured circles, squares and triangles, and gives every other picture a confident shape caption. "
    f"For real images name a Qwen VL checkpoint: --model {REAL_MODEL_EXAMPLE} (or LLM(\"{REAL_MODEL_EXAMPLE}\"), "
    "model=...); a hub id downloads once into the HF cache.")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_model_path() -> Path:
    """The shipped checkpoint directory (an HF checkpoint: config.json, safetensors, tokenizer, ...)."""
    return repo_root() / "assets" / "model" / MODEL_DIR_NAME


def resolve_model(model: Optional[str], announce: bool = True) -> str:
    """`model` itself, or the bundled checkpoint's directory when no model is named (None or ""); then,
    with `announce` (the call that starts the run; a check of the command line passes False), the
    notice that the bundled model runs."""
    if model:
        return model
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model given and the bundled default model is missing from {path}; "
                                "pass a checkpoint directory or hub id (model=... / --model)")
    if announce:
        logger.warning(BUNDLED_MODEL_NOTICE.format(path=path))
    return str(path)


def is_bundled(model: Optional[str]) -> bool:
    """Whether `model` (a name, a path, or a served model id) is the bundled shapes model."""
    if not model:
        return True
    return model == MODEL_DIR_NAME or Path(model).name == MODEL_DIR_NAME


def served_name(model: Optional[str]) -> str:
    """The id a server lists for `model`: the name given, or the bundled model's name."""
    return model or MODEL_DIR_NAME
