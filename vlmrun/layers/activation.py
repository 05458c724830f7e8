"""Activation functions used by the model MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """Gated SiLU: `silu(gate) * up` where the input is `cat([gate, up], -1)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * d] -> [num_tokens, d]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


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
