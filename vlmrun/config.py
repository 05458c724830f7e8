"""Engine and model configuration.

`EngineConfig` is the one dataclass of user-facing knobs (vLLM-style names). `ModelConfig` wraps
the checkpoint's HF config and answers the questions the engine asks of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # checkpoint dir or hub id; None = the bundled default model
    revision: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use (CUDA)
    kv_cache_memory_bytes: Optional[int] = None  # explicit KV budget; default on CPU: 2 GiB
    encoder_cache_tokens: int = 32768  # vision embeddings kept by image hash
    max_images_per_request: int = 32
    max_image_pixels: Optional[int] = None  # decompression-bomb cap; None = processors' default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        return device


@dataclass
class ModelConfig:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_path(cls, path: Path, engine: EngineConfig, device: torch.device) -> "ModelConfig":
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError) as e:
            raise ValueError(f"cannot read the model config in {path}: {e}") from e
        if not getattr(hf_config, "architectures", None):
            raise ValueError(f"{path}/config.json names no 'architectures'")
        dtype = resolve_dtype(engine.dtype, hf_config, device)
        text = text_config(hf_config)
        limit = getattr(text, "max_position_embeddings", None) or 32768
        max_len = engine.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
        return cls(path=path, hf_config=hf_config, dtype=dtype, max_model_len=max_len,
                   eos_token_ids=read_eos_token_ids(path, hf_config))

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def text_config(self) -> Any:
        return text_config(self.hf_config)

    @property
    def is_multimodal(self) -> bool:
        return getattr(self.hf_config, "vision_config", None) is not None


def text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # the CPU reference path runs in float32
    stored = getattr(text_config(hf_config), "dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def read_eos_token_ids(path: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json, falling back to the model config."""
    ids: Any = None
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(text_config(hf_config), "eos_token_id", None) or getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
