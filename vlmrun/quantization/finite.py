"""Quantization scales that are NaN or inf are refused when the checkpoint loads.

A scale multiplies every weight of its block or group: one NaN scale turns a layer's outputs into NaN
for every request, so a checkpoint holding one is broken and never served. `check_scales` is called by
the linear methods on each scale tensor as it is read (`checkpoint_tensor`), naming the checkpoint
tensor when the loader knows it (`vlmrun.loader.LazyTensor.name`).
"""

from __future__ import annotations

from typing import Any

import torch


def check_scales(tensor: torch.Tensor, name: str, source: Any = None) -> torch.Tensor:
    """`tensor` (a scale tensor, already read) as it is; a ValueError naming it when a value is NaN or inf.
    `source`: what the tensor was read from (a `LazyTensor` carries the checkpoint's tensor name)."""
    bad = ~torch.isfinite(tensor)
    if bad.any():
        where = getattr(source, "name", None) or name
        raise ValueError(f"{where}: {int(bad.sum())} of {tensor.numel()} quantization scales are NaN or inf; "
                         f"the checkpoint is broken and is not loaded")
    return tensor
