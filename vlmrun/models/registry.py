"""Map HF `architectures` names to vlmrun model classes (imported lazily, on first use); build and load one.

Adding a model: its file under `vlmrun/models/` (a `Model` subclass) and one line in `_MODELS`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Iterable

import torch

from vlmrun.config import ModelConfig
from vlmrun.loader import checkpoint_tensor_names, iter_lazy_weights
from vlmrun.models.base import Model
from vlmrun.models.weights import build_model, finish_loading, weight_bytes
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.quantization.assign import assign_linear_methods, make_linear_method

logger = logging.getLogger(__name__)

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


def build_for_checkpoint(model_config: ModelConfig, device: torch.device, checkpoint_names: Iterable[str],
                         tp: TensorParallel = SINGLE, fp8_kernel: str = "dequantize") -> Model:
    """The checkpoint's model with empty storage on `device` (on the meta device: none, so its bytes
    can be counted at any size), each linear layer given its method (`vlmrun.quantization.assign`)
    from `model_config.quantization` and the checkpoint's tensor names `checkpoint_names`."""
    cls = get_model_class(model_config.hf_config.architectures)
    quantization = model_config.quantization

    def assign_methods(model: Model) -> None:
        method = make_linear_method(quantization, device, fp8_kernel)
        count = assign_linear_methods(model, quantization, method, checkpoint_names, model.checkpoint_name)
        logger.info("quantization %s: %d linear layers quantized", quantization.describe(), count)

    return build_model(cls, model_config.hf_config, model_config.dtype, device, tp,
                       prepare=assign_methods if quantization is not None else None)


def load_model(model_config: ModelConfig, device: torch.device, tp: TensorParallel = SINGLE,
               fp8_kernel: str = "dequantize") -> Model:
    """The checkpoint's model on `device` in `model_config.dtype`, every parameter loaded (this
    rank's share of each under tensor parallelism: sharded layers read only their slices). A quantized
    checkpoint's layers (`model_config.quantization`) keep its format (`vlmrun.quantization`)."""
    try:
        names = checkpoint_tensor_names(model_config.path) if model_config.quantization is not None else ()
        model = build_for_checkpoint(model_config, device, names, tp, fp8_kernel)
        model.load_weights(iter_lazy_weights(model_config.path))  # raises, naming them, if a parameter is left unset
    except ValueError as e:
        raise ValueError(f"{model_config.path}: {e}") from e
    finish_loading(model)
    logger.info("model weights: %.2f GiB on %s", weight_bytes(model) / 2**30, device)
    return model.eval()
