"""Sparse mixture-of-experts MLP (Qwen3-MoE / Qwen3-VL-MoE / Qwen3-Next / Qwen3.5-MoE).

Routing, as HF's Qwen MoE blocks: router logits = x @ gate.T; softmax in float32 over all experts;
top-k; optionally renormalise the k weights to sum to 1; cast to the activation dtype. Each chosen
expert runs a SwiGLU MLP on its tokens, scaled by the token's routing weight, and the results are
summed (in expert order). An optional shared expert runs on every token, scaled by
sigmoid(shared_expert_gate(x)), and is added on top.

Expert weights live fused, as transformers 5 stores them: `experts.gate_up_proj` [E, 2*I, H]
(gate rows then up rows) and `experts.down_proj` [E, H, I]; the one checkpoint loader
(`vlmrun.models.weights.load_checkpoint`) also fills them from per-expert or transposed tensors.

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


class FusedExperts(nn.Module):
    """E SwiGLU experts with fused weights; forward runs each token through its top-k experts."""

    cuda_graph_capturable = False  # forward reads per-expert token counts on the host

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]
        self.act_fn = get_act_fn(act)

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
            if n == 0:
                continue
            rows = order[start:start + n]  # [n] assignment indices
            start += n
            tokens = rows // k
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # [n, H]
            out.index_add_(0, tokens, y * flat_weights[rows, None])
        return out


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ gated shared expert). Parameter names follow HF:
    `gate.weight`, `experts.gate_up_proj`, `experts.down_proj`, `shared_expert.{gate,up,down}_proj.weight`,
    `shared_expert_gate.weight`."""

    def __init__(self, hidden: int, moe_intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, act: str = "silu", shared_intermediate: int = 0):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, moe_intermediate, act)
        self.shared_expert: Optional[SwiGLUMLP] = None
        if shared_intermediate > 0:
            self.shared_expert = SwiGLUMLP(hidden, shared_intermediate, act)
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
        return out


def is_moe_layer(config: Any, i: int) -> bool:
    """HF's rule: MoE unless listed in mlp_only_layers, when experts exist and (i + 1) % decoder_sparse_step == 0."""
    return (i not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0
            and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def moe_block(config: Any, *, shared: bool, norm_topk_prob: bool) -> SparseMoeBlock:
    """The sparse MoE block a text config describes (`shared`: with its shared expert)."""
    return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                          config.num_experts_per_tok, norm_topk_prob=norm_topk_prob,
                          act=getattr(config, "hidden_act", "silu"),
                          shared_intermediate=config.shared_expert_intermediate_size if shared else 0)
