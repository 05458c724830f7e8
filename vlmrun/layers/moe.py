"""Sparse mixture-of-experts MLP (Qwen3-MoE / Qwen3-VL-MoE / Qwen3-Next / Qwen3.5-MoE).

Routing, as HF's Qwen MoE blocks: router logits = x @ gate.T; softmax in float32 over all experts;
top-k; optionally renormalise the k weights to sum to 1; cast to the activation dtype. Each chosen
expert runs a SwiGLU MLP on its tokens, scaled by the token's routing weight, and the results are
summed (in expert order). An optional shared expert runs on every token, scaled by
sigmoid(shared_expert_gate(x)), and is added on top.

Expert weights live fused, as transformers 5 stores them: `experts.gate_up_proj` [E, 2*I, H]
(gate rows then up rows) and `experts.down_proj` [E, H, I]; the one checkpoint loader
(`vlmrun.models.weights.load_checkpoint`) also fills them from per-expert or transposed tensors.

Tensor parallelism slices every expert (`tp`): each rank holds `I / size` of each expert's hidden
units (gate and up rows, down columns; `shard_full` / `shard_piece` cut a checkpoint tensor to
them). With `tp.expert_parallel` each rank holds `E / size` whole experts instead and runs only
the assignments routed to them. The shared expert is sliced either way; the block sums experts
and shared expert on this rank and all-reduces once.

The expert loop is the torch reference: one host sync per layer (the per-expert token counts), one
gathered matmul pair per expert that received tokens. A fused grouped-GEMM kernel replaces it on GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.layers.activation import get_act_fn
from vlmrun.layers.mlp import SwiGLUMLP
from vlmrun.parallel import SINGLE, Shard, TensorParallel


class FusedExperts(nn.Module):
    """E SwiGLU experts with fused weights; forward runs each token through its top-k experts."""

    cuda_graph_capturable = False  # forward reads per-expert token counts on the host

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_experts = num_experts  # all of them
        self.hidden = hidden
        if tp.expert_parallel:
            self.experts = tp.split(num_experts, "experts")  # this rank's experts, whole
            self.shard = Shard(intermediate, 0, intermediate)
        else:
            self.experts = Shard(num_experts, 0, num_experts)
            self.shard = tp.split(intermediate, "expert intermediate units")  # this rank's units of each
        self.intermediate = self.shard.length
        local = self.experts.length
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * self.intermediate, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(local, hidden, self.intermediate))  # [E, H, I]
        self.act_fn = get_act_fn(act)

    def full_shape(self, name: str) -> tuple[int, int, int]:
        """The unsharded checkpoint shape of `gate_up_proj` or `down_proj`."""
        full = self.shard.total
        return (self.num_experts, 2 * full, self.hidden) if name == "gate_up_proj" else (self.num_experts, self.hidden, full)

    def local_expert(self, e: int) -> Optional[int]:
        """Expert `e`'s index among this rank's experts, None when another rank holds it."""
        local = e - self.experts.start
        return local if 0 <= local < self.experts.length else None

    def shard_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A full fused tensor ([E, 2I, H] or [E, H, I]) -> this rank's part of it."""
        s = self.shard
        tensor = tensor.narrow(0, self.experts.start, self.experts.length)
        if name == "down_proj":
            return tensor.narrow(2, s.start, s.length)
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([gate.narrow(1, s.start, s.length), up.narrow(1, s.start, s.length)], dim=1)

    def shard_piece(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """One expert's `gate_proj` / `up_proj` [I, H] or `down_proj` [H, I] -> this rank's rows / columns."""
        return tensor.narrow(1 if kind == "down_proj" else 0, self.shard.start, self.shard.length)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids, weights: [T, k] -> [T, H]
        k = expert_ids.shape[1]
        flat = expert_ids.flatten()  # [T*k], token-major
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            local = self.local_expert(e)
            if n == 0 or local is None:
                start += n
                continue
            rows = order[start:start + n]  # [n] assignment indices
            start += n
            tokens = rows // k
            gate, up = F.linear(x[tokens], self.gate_up_proj[local]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.act_fn(gate) * up, self.down_proj[local])  # [n, H]
            out.index_add_(0, tokens, y * flat_weights[rows, None])
        return out


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ gated shared expert). Parameter names follow HF:
    `gate.weight`, `experts.gate_up_proj`, `experts.down_proj`, `shared_expert.{gate,up,down}_proj.weight`,
    `shared_expert_gate.weight`."""

    def __init__(self, hidden: int, moe_intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, act: str = "silu", shared_intermediate: int = 0,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router: replicated
        self.experts = FusedExperts(num_experts, hidden, moe_intermediate, act, tp)
        self.shared_expert: Optional[SwiGLUMLP] = None
        if shared_intermediate > 0:
            self.shared_expert = SwiGLUMLP(hidden, shared_intermediate, act, tp=tp, reduce=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # [T, H]: this rank's expert units summed with the others


def is_moe_layer(config: Any, i: int) -> bool:
    """HF's rule: MoE unless listed in mlp_only_layers, when experts exist and (i + 1) % decoder_sparse_step == 0."""
    return (i not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0
            and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def moe_block(config: Any, *, shared: bool, norm_topk_prob: bool, tp: TensorParallel = SINGLE) -> SparseMoeBlock:
    """The sparse MoE block a text config describes (`shared`: with its shared expert)."""
    return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                          config.num_experts_per_tok, norm_topk_prob=norm_topk_prob,
                          act=getattr(config, "hidden_act", "silu"),
                          shared_intermediate=config.shared_expert_intermediate_size if shared else 0, tp=tp)
