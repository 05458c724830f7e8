"""Activation functions used by the model MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def get_act_fn(name: str):
    """Elementwise activation by its HF `hidden_act` name."""
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported activation {name!r}")
