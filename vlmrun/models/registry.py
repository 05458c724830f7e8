"""Map HF `architectures` names to vlmrun model classes (imported lazily, on first use); build and load one;
ask a checkpoint's family for a prompt's positions (`prompt_positions`).

The table is `vlmrun.families.FAMILIES` (one line per family, on the bottom floor so the input processors
read it too). Adding a model: docs/adding_a_model.md.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Iterable, Sequence

import torch

from vlmrun.config import ModelConfig
from vlmrun.families import FAMILIES, family_of
from vlmrun.loader import checkpoint_tensor_names, iter_lazy_weights
from vlmrun.models.base import Model
from vlmrun.models.weights import build_model, finish_loading, weight_bytes
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.quantization.assign import assign_linear_methods, make_linear_method

logger = logging.getLogger(__name__)


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def get_model_class(architectures: list[str]) -> type:
    """The class for the first supported name in `architectures`; ValueError if none is supported."""
    found = family_of(architectures)
    if found is not None:
        return getattr(importlib.import_module(found[1].module), found[1].class_name)
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def prompt_positions(hf_config: Any, token_ids: Sequence[int], mm_items: Sequence[Any]) -> tuple[torch.Tensor, int]:
    """A prompt's positions [3, L] int64 and its decode delta, as the checkpoint's family places them
    (`Model.prompt_positions`: M-RoPE for the VL families, 1-D for text-only ones). `mm_items`: the
    prompt's media items (`grid_thw`, `second_per_grid_t`), in prompt order. ValueError for items that do
    not match the prompt's placeholder runs."""
    return get_model_class(hf_config.architectures).prompt_positions(hf_config)(token_ids, mm_items)


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
