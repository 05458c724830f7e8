"""Give each linear layer of a freshly built model its linear method (`vlmrun.layers.linear_method`).

Runs on the meta device, before the model's storage is made: a quantized layer registers its
method's tensors (FP8 weight and scales, int4 packed weight, zeros and scales) in place of the float
weight. Which layers: the checkpoint's module names of each of our layers (its fused parts' and
experts' names) are found by renaming the checkpoint's tensor names the way the loader will; a
layer is quantized when the config quantizes those modules (`QuantizationConfig.quantizes`) and
the checkpoint holds the method's tensors for them (a float checkpoint under online FP8: always).
A module the config leaves unquantized but the checkpoint stores quantized, or a fused layer whose
parts disagree, is a ValueError naming it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.layers.linear import LinearBase, fused_part_aliases
from vlmrun.layers.linear_method import LinearMethod
from vlmrun.layers.moe import PER_EXPERT_TENSOR, FusedExperts

# The tensor that marks a module quantized in a checkpoint, by method.
_MARKERS = {"fp8": "weight_scale_inv", "awq": "qweight", "gptq": "qweight"}


def make_linear_method(config: QuantizationConfig, device: torch.device, fp8_kernel: str = "dequantize") -> LinearMethod:
    """The method quantized layers use under `config` on `device`."""
    if config.method == "fp8":
        from vlmrun.quantization.fp8 import make_fp8_method

        return make_fp8_method(config, device, fp8_kernel)
    from vlmrun.quantization.int4 import Int4Linear

    return Int4Linear(config)


def assign_linear_methods(model: nn.Module, config: QuantizationConfig, method: LinearMethod,
                          checkpoint_names: Iterable[str], rename: Callable[[str], Optional[str]]) -> int:
    """Moves the layers `config` quantizes to `method`; returns how many. `checkpoint_names`: every
    tensor name of the checkpoint; `rename`: the model's checkpoint-name -> parameter-name map."""
    modules, quantized_in_checkpoint = _checkpoint_modules(model, checkpoint_names, rename, _MARKERS[config.method])
    tp_size = getattr(getattr(model, "tp", None), "size", 1)
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, (LinearBase, FusedExperts)) or name not in modules:
            continue
        hf_modules = sorted(modules[name])
        wanted = {m: config.quantizes(m) for m in hf_modules}
        stored = {m: config.online or m in quantized_in_checkpoint for m in hf_modules}
        wrong = [m for m in hf_modules if stored[m] and not wanted[m]]
        if wrong and not config.online:
            raise ValueError(f"{wrong[0]}: the checkpoint stores it quantized ({config.method}) but its "
                             f"quantization_config lists it among the unquantized modules")
        decided = {m: wanted[m] and stored[m] for m in hf_modules}
        if len(set(decided.values())) > 1:
            raise ValueError(f"{name}: the checkpoint modules fused into it are quantized in part only "
                             f"({', '.join(m for m in hf_modules if decided[m])} but not "
                             f"{', '.join(m for m in hf_modules if not decided[m])}); that layout is not supported")
        if all(decided.values()):
            layer.use_method(method, name, tp_size)
            count += 1
    return count


def _checkpoint_modules(model: nn.Module, checkpoint_names: Iterable[str], rename: Callable[[str], Optional[str]],
                        marker: str) -> tuple[dict[str, set[str]], set[str]]:
    """(our layer name -> the checkpoint module names loaded into it, checkpoint modules holding `marker`)."""
    aliases = fused_part_aliases(model)
    layers: dict[str, set[str]] = defaultdict(set)
    marked: set[str] = set()
    for hf_name in checkpoint_names:
        module, _, tensor = hf_name.rpartition(".")
        if tensor == marker or tensor.endswith("_scale_inv") and marker == "weight_scale_inv":
            marked.add(module)
        ours = rename(f"{module}.weight")
        if ours is None:
            continue
        ours, _ = aliases.get(ours, (ours, None))
        m = PER_EXPERT_TENSOR.match(ours)
        layers[m["prefix"] if m else ours.rpartition(".")[0]].add(module)
    return layers, marked
