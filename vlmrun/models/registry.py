"""Map HF `architectures` names to vlmrun model classes (imported lazily, on first use); build and load one.

Adding a model: its file under `vlmrun/models/` (a `Model` subclass) and one line in `_MODELS`.
"""

from __future__ import annotations

import importlib

import torch

from vlmrun.config import ModelConfig
from vlmrun.loader import iter_lazy_weights
from vlmrun.models.base import Model
from vlmrun.models.weights import build_model
from vlmrun.parallel import SINGLE, TensorParallel

# architecture name -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("vlmrun.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("vlmrun.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("vlmrun.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("vlmrun.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("vlmrun.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("vlmrun.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("vlmrun.models.qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type:
    """The class for the first supported name in `architectures`; ValueError if none is supported."""
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def load_model(model_config: ModelConfig, device: torch.device, tp: TensorParallel = SINGLE) -> Model:
    """The checkpoint's model on `device` in `model_config.dtype`, every parameter loaded (this
    rank's share of each under tensor parallelism: sharded layers read only their slices)."""
    cls = get_model_class(model_config.hf_config.architectures)
    model = build_model(cls, model_config.hf_config, model_config.dtype, device, tp)
    try:
        model.load_weights(iter_lazy_weights(model_config.path))  # raises, naming them, if a parameter is left unset
    except ValueError as e:
        raise ValueError(f"{model_config.path}: {e}") from e
    return model.eval()
