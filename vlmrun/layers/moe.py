"""Sparse mixture-of-experts MLP (Qwen3-MoE / Qwen3-VL-MoE / Qwen3-Next / Qwen3.5-MoE) and its weight loading.

Routing, as HF's Qwen MoE blocks: router logits = x @ gate.T; softmax in float32 over all experts;
top-k; optionally renormalise the k weights to sum to 1; cast to the activation dtype. Each chosen
expert runs a SwiGLU MLP on its tokens, scaled by the token's routing weight, and the results are
summed (in expert order). An optional shared expert runs on every token, scaled by
sigmoid(shared_expert_gate(x)), and is added on top.

Expert weights live fused, as transformers 5 stores them: `experts.gate_up_proj` [E, 2*I, H]
(gate rows then up rows) and `experts.down_proj` [E, H, I]. `load_checkpoint` also takes per-expert
tensors (`experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]) as hub
checkpoints store them, and fused tensors saved transposed ([E, H, 2*I] / [E, I, H]) as the
Qwen3-VL-MoE hub checkpoints store them.

The expert loop is the torch reference: one host sync per layer (the per-expert token counts), one
gathered matmul pair per expert that received tokens. A fused grouped-GEMM kernel replaces it on GPU.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.layers.activation import get_act_fn
from vlmrun.layers.mlp import SwiGLUMLP


class FusedExperts(nn.Module):
    """E SwiGLU experts with fused weights; forward runs each token through its top-k experts."""

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


# --------------------------------------------------------------------------------------------
# Weight loading
# --------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = ("experts.gate_up_proj", "experts.down_proj")

Rename = Callable[[str], Optional[str]]
Transform = Callable[[str, torch.Tensor], torch.Tensor]


def load_checkpoint(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename, *,
                    transform: Optional[Transform] = None, optional: Iterable[str] = ()) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters; MoE expert layouts are converted on the way.

    `rename(hf_name)` gives our parameter name (per-expert names keep their `experts.{e}.*` tail) or
    None to skip; `transform(our_name, tensor)` may rearrange a tensor before the copy (e.g. reorder
    fused projection rows). A tensor whose shape fits neither the parameter nor (for fused experts)
    its transpose raises, naming it; so does any parameter the checkpoint leaves unset. Returns the
    set of loaded parameter names.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    expert_pieces: dict[str, set[tuple[int, str]]] = {}  # fused param -> (expert, kind) pieces seen
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        m = _PER_EXPERT.match(name)
        if m:
            kind = m["kind"]
            target = f"{m['prefix']}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
            if target not in params:
                continue
            param, e = params[target], int(m["e"])
            if e >= param.shape[0]:
                raise ValueError(f"{hf_name}: expert {e} out of range, the model has {param.shape[0]} experts")
            half = param.shape[1] // 2
            dst = {"gate_proj": param[e, :half], "up_proj": param[e, half:], "down_proj": param[e]}[kind]
            _copy(dst, tensor, hf_name, target)
            expert_pieces.setdefault(target, set()).add((e, kind))
            continue
        if name not in params:
            continue
        param = params[name]
        if transform is not None:
            tensor = transform(name, tensor)
        if name.endswith(_FUSED) and tensor.shape != param.shape and tensor.dim() == 3 \
                and tensor.transpose(1, 2).shape == param.shape:
            tensor = tensor.transpose(1, 2)  # fused experts saved as [E, in, out]
        _copy(param, tensor, hf_name, name)
        loaded.add(name)
    for target, pieces in expert_pieces.items():
        num_experts = params[target].shape[0]
        kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        absent = [f"{e}.{k}" for e in range(num_experts) for k in kinds if (e, k) not in pieces]
        if absent:
            shown = ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else "")
            raise ValueError(f"{target}: the checkpoint lacks {len(absent)} per-expert weights: experts.{shown}")
        loaded.add(target)
    missing = sorted(set(params) - loaded - set(optional))
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} parameters missing from the checkpoint: {shown}")
    return loaded


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch for {hf_name} -> {name}: checkpoint {tuple(src.shape)}, "
                         f"model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
