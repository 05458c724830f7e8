"""Checkpoint files: a local HF checkpoint dir or a hub id → its path, and its weights streamed by name.

Hub ids go through huggingface_hub, which honours its cache and `HF_HUB_OFFLINE`. Weights are
streamed from (sharded) safetensors; `vlmrun.models.registry.load_model` builds the model and each
model's `load_weights` maps HF names onto its own. `iter_lazy_weights` streams them unread
(`LazyTensor`): a tensor-parallel rank reads only its slice of each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional, Union

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


class LazyTensor:
    """A checkpoint tensor not read yet: its `shape`, `narrow(dim, start, length)` reading only those
    rows, `load()` reading it all. Valid while the iteration that yielded it has not moved on. `name`:
    the checkpoint's name of it (for errors about its values)."""

    def __init__(self, tensor_slice: Any, name: str = ""):
        self._slice = tensor_slice  # safetensors' PySafeSlice
        self.shape = torch.Size(tensor_slice.get_shape())
        self.name = name

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._slice[...]


def materialize(tensor: Union[torch.Tensor, LazyTensor]) -> torch.Tensor:
    """The tensor itself, read in full when it is still lazy."""
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


def iter_lazy_weights(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name), name)


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor name of the checkpoint, read from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    names = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names
