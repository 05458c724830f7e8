"""The SwiGLU MLP: down(act(gate(x)) * up(x)), the dense MLP of the Qwen text models, the MoE shared
expert, and (with biases) the Qwen2.5-VL vision blocks."""

from __future__ import annotations

import torch
from torch import nn

from vlmrun.layers.activation import get_act_fn


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
