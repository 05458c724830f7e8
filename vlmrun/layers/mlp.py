"""The SwiGLU MLP: down(act(gate(x)) * up(x)), the dense MLP of the Qwen text models, the MoE shared
expert, and (with biases) the Qwen2.5-VL vision blocks.

gate and up are one fused column-parallel linear (`gate_up_proj`, loaded from the checkpoint's
`gate_proj` and `up_proj`), down is row-parallel: under tensor parallelism each rank holds
`intermediate / size` of the hidden units and the down projection sums over the ranks
(`reduce=False` leaves that sum to the caller).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmrun.layers.activation import get_act_fn
from vlmrun.layers.linear import ColumnParallelLinear, RowParallelLinear
from vlmrun.parallel import SINGLE, TensorParallel


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce: bool = True):
        super().__init__()
        shard = tp.split(intermediate, "MLP intermediate units")
        self.gate_up_proj = ColumnParallelLinear(hidden, [shard, shard], bias, part_names=("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, bias, reduce=reduce)
        self.act_fn = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate / size] each
        return self.down_proj(self.act_fn(gate) * up)
