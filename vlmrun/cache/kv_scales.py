"""The float8 KV cache's per-layer scales, read from the checkpoint as vLLM reads them.

A checkpoint calibrated for an FP8 KV cache stores, per decoder layer's attention, one scale for K and
one for V, under one of the names vLLM accepts:

    <...>.layers.<i>.self_attn.k_proj.k_scale / v_proj.v_scale   (compressed-tensors, ModelOpt)
    <...>.layers.<i>.self_attn.k_scale / v_scale                   (or under .attn.)
    <...>.layers.<i>.self_attn.kv_scale                            (older FP8 checkpoints: one for both)

A stored value is the real K (V) divided by the scale, so the cache writes k / k_scale and reads
stored * k_scale. A layer without a scale gets 1.0, as in vLLM. Only per-tensor scales exist here: a
scale of more than one value is refused, naming it. The vision tower's and an MTP layer's tensors are
not the language model's attention and are skipped.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Mapping

from vlmrun.loader import iter_lazy_weights

logger = logging.getLogger(__name__)

SCALE_NAME = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\.(?:\w+\.)?(?P<kind>k_scale|v_scale|kv_scale)$")
SKIPPED_PREFIXES = ("visual.", "model.visual.", "mtp.", "model.mtp.")


def decoder_layer_index(module_name: str) -> int | None:
    """The decoder layer a module or tensor of the language model belongs to (`...layers.<i>....`), or None."""
    if module_name.startswith(SKIPPED_PREFIXES):
        return None
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
    return int(found.group(1)) if found else None


def read_kv_scales(path: Path, kv_layer_of: Mapping[int, int], num_kv_layers: int) -> tuple[list[float], list[float]]:
    """Per KV-pool layer, (k scales, v scales) from the checkpoint at `path`; `kv_layer_of` maps a decoder
    layer index to its KV-pool layer (full-attention layers only). Missing: 1.0. ValueError for a scale
    that is not one positive finite number."""
    k_scales, v_scales = [1.0] * num_kv_layers, [1.0] * num_kv_layers
    found = 0
    for name, lazy in iter_lazy_weights(path):
        match = SCALE_NAME.search(name)
        if match is None or name.startswith(SKIPPED_PREFIXES):
            continue
        layer = kv_layer_of.get(int(match["layer"]))
        if layer is None:  # a layer without full attention (or beyond the model)
            continue
        tensor = lazy.load()
        if tensor.numel() != 1:
            raise ValueError(f"{name}: a KV cache scale of shape {tuple(tensor.shape)}; only per-tensor "
                             f"(one value) scales are supported")
        value = float(tensor.float().reshape(()))
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name}: KV cache scale {value} is not a positive finite number")
        kind = match["kind"]
        if kind in ("k_scale", "kv_scale"):
            k_scales[layer] = value
        if kind in ("v_scale", "kv_scale"):
            v_scales[layer] = value
        found += 1
    if not found:
        logger.info("fp8 KV cache: the checkpoint has no k_scale / v_scale; every layer's scales are 1.0")
    return k_scales, v_scales
