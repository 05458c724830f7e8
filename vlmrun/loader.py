"""Checkpoint files: a local HF checkpoint dir or a hub id → its path, and its weights streamed by name.

Hub ids go through huggingface_hub, which honours its cache and `HF_HUB_OFFLINE`. Weights are
streamed from (sharded) safetensors; `vlmrun.models.registry.load_model` builds the model and each
model's `load_weights` maps HF names onto its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import torch

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_path(model: str, revision: Optional[str] = None) -> Path:
    """A local directory as is; otherwise a hub id fetched (or found in the cache) by huggingface_hub."""
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"{local} is not an HF checkpoint: config.json is missing")
        return local
    if local.exists():
        raise ValueError(f"{local} is a file; pass the checkpoint directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS))
    except HFValidationError as e:
        raise FileNotFoundError(f"{model!r} is neither a local checkpoint directory nor a valid hub id") from e
    except Exception as e:  # offline with nothing cached, unknown repo, no network, ...
        raise FileNotFoundError(
            f"could not get model {model!r} from the Hugging Face hub or its cache: {type(e).__name__}: {e}"
        ) from e


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in {index.name} are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    return files


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
