"""Sparse mixture-of-experts MLP (Qwen3-MoE / Qwen3-VL-MoE / Qwen3-Next / Qwen3.5-MoE).

Routing, as HF's Qwen MoE blocks: router logits = x @ gate.T; softmax in float32 over all experts;
top-k; optionally renormalise the k weights to sum to 1; cast to the activation dtype. Each chosen
expert runs a SwiGLU MLP on its tokens, scaled by the token's routing weight, and the results are
summed (in expert order). An optional shared expert runs on every token, scaled by
sigmoid(shared_expert_gate(x)), and is added on top.

Expert weights live fused, as transformers 5 stores them: `experts.gate_up_proj` [E, 2*I, H]
(gate rows then up rows) and `experts.down_proj` [E, H, I], in the format of the experts' linear
method (FP8 adds `gate_up_proj_scale_inv` / `down_proj_scale_inv`); the one checkpoint loader
(`vlmrun.models.weights.load_checkpoint`) also fills them from per-expert or transposed tensors.

Tensor parallelism slices every expert (`tp`): each rank holds `I / size` of each expert's hidden
units (gate and up rows, down columns; `load_piece` / `load_fused` cut a checkpoint tensor to
them). With `tp.expert_parallel` each rank holds `E / size` whole experts instead and runs only
the assignments routed to them. The shared expert is sliced either way; the block sums experts
and shared expert on this rank and all-reduces once.

Routing runs on the device with no host sync (`vlmrun.layers.grouped_matmul`): the (token, expert)
assignments are sorted by expert there and every expert's rows go through one grouped matmul per
projection (torch's grouped GEMM on the CPU and on CUDA bfloat16 sm90/sm100; elsewhere, for
decode-sized batches, a gathered batched matmul). The per-expert loop, which reads each expert's row
count on the host, remains for quantized experts and batches too large for the gathered fallback.
LoRA on the experts takes the same path (`vlmrun.lora.layers.ExpertsLoRA.add_grouped`: the low-rank
update as two more grouped matmuls, the rows grouped by expert, or by adapter slot and expert in a
mixed batch).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.layers.activation import get_act_fn
from vlmrun.layers.grouped_matmul import RoutedRows, grouped_linear, runs_sync_free
from vlmrun.layers.linear import ReplicatedLinear, copy_checked, named_specs
from vlmrun.layers.linear_method import UNQUANTIZED, LinearMethod, ParamSpec
from vlmrun.loader import materialize
from vlmrun.layers.mlp import SwiGLUMLP
from vlmrun.parallel import SINGLE, Shard, TensorParallel

# A checkpoint's per-expert tensor, under our module names: `<prefix>.experts.<e>.<kind>.<name>`.
PER_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.(?P<name>\w+)$")


def expert_param_name(projection: str, name: str) -> str:
    """The fused experts' parameter for tensor `name` of a method (`weight` -> `gate_up_proj`,
    `weight_scale_inv` -> `gate_up_proj_scale_inv`, as transformers names them; `qweight` ->
    `gate_up_proj_qweight`)."""
    return projection + name[len("weight"):] if name.startswith("weight") else f"{projection}_{name}"


class FusedExperts(nn.Module):
    """E SwiGLU experts with fused weights; forward runs each token through its top-k experts.

    The weights' format is `self.method`'s (`vlmrun.layers.linear_method`): each projection keeps the
    method's tensors with a leading expert dim; `forward` takes one expert's [out, in] weights from
    `method.dequantize` (the tensors themselves when unquantized)."""

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
        self.param_names: dict[str, tuple[str, ...]] = {}  # projection -> its method's tensor names
        self.stored_dtypes: dict[str, torch.dtype] = {}
        self.use_method(UNQUANTIZED)
        self.act_fn = get_act_fn(act)
        self.lora: Optional[Any] = None  # LoRA adapters of the experts (`vlmrun.lora.layers.ExpertsLoRA`)

    def use_method(self, method: LinearMethod, layer_name: str = "", tp_size: int = 1) -> None:
        """Registers `method`'s (empty) tensors for both projections: [E, *spec shape] each."""
        for projection, names in self.param_names.items():
            for name in names:
                delattr(self, expert_param_name(projection, name))
        self.param_names, self.stored_dtypes = {}, {}
        name_of_layer = layer_name or "experts"
        for projection in PROJECTIONS:
            for name, spec in self._specs(method, projection, self.shard.total, name_of_layer).items():
                self._check_alignment(method, projection, name, spec, layer_name, tp_size)
            specs = self._specs(method, projection, self.intermediate, name_of_layer)
            for name, spec in specs.items():
                shape = list(spec.shape)
                if projection == "gate_up_proj" and spec.out_dim is not None:  # gate rows then up rows
                    shape[spec.out_dim] *= 2
                ours = expert_param_name(projection, name)
                self.register_parameter(ours, nn.Parameter(
                    torch.empty(self.experts.length, *shape, dtype=spec.dtype or torch.float32), requires_grad=False))
                if spec.dtype is not None:
                    self.stored_dtypes[ours] = spec.dtype
            self.param_names[projection] = tuple(specs)
        self.method = method

    def swap_method(self, method: LinearMethod, tensors: dict[str, torch.Tensor]) -> None:
        """Moves the loaded experts to `method` with its tensors given filled, [E, ...] each by our parameter
        name (`gate_up_proj`, `gate_up_proj_scale_inv`, ...: experts quantized after loading, online FP8)."""
        for projection, names in self.param_names.items():
            for name in names:
                delattr(self, expert_param_name(projection, name))
        self.param_names = {p: tuple(self._specs(method, p, self.intermediate)) for p in PROJECTIONS}
        self.stored_dtypes = {}
        for projection, names in self.param_names.items():
            for name in names:
                ours = expert_param_name(projection, name)
                self.register_parameter(ours, nn.Parameter(tensors[ours], requires_grad=False))
                self.stored_dtypes[ours] = tensors[ours].dtype
        self.method = method

    def _specs(self, method: LinearMethod, projection: str, units: int,
               layer_name: str = "experts") -> dict[str, ParamSpec]:
        """The method's tensors of one expert's `gate_proj` (or `up_proj`) or `down_proj` over `units` hidden units."""
        shape = (units, self.hidden) if projection == "gate_up_proj" else (self.hidden, units)
        return named_specs(method, *shape, f"{layer_name}.{projection}")

    def _check_alignment(self, method: LinearMethod, projection: str, name: str, spec: ParamSpec,
                         layer_name: str, tp_size: int) -> None:
        pack = spec.out_pack if projection == "gate_up_proj" else spec.in_pack
        dim = spec.out_dim if projection == "gate_up_proj" else spec.in_dim
        s = self.shard
        if dim is None or pack == 1 or s.length == s.total:
            return
        if s.start % pack or (s.length % pack and s.start + s.length != s.total):
            raise ValueError(
                f"{layer_name or 'experts'}: tensor_parallel_size={tp_size} gives this rank expert units "
                f"[{s.start}, {s.start + s.length}) of {s.total}, but {method.name}'s {name} stores them {pack} "
                f"to an element: each rank's share must be whole {pack}-wide blocks (or use expert parallelism)")

    # ------------------------------------------------------------------ loading

    def local_expert(self, e: int) -> Optional[int]:
        """Expert `e`'s index among this rank's experts, None when another rank holds it."""
        local = e - self.experts.start
        return local if 0 <= local < self.experts.length else None

    def piece_target(self, kind: str, name: str) -> str:
        """Our parameter for tensor `name` of a checkpoint's per-expert `gate_proj` / `up_proj` / `down_proj`."""
        return expert_param_name("down_proj" if kind == "down_proj" else "gate_up_proj", name)

    def load_piece(self, kind: str, name: str, tensor: Any, e: int, hf_name: str) -> None:
        """One expert's checkpoint tensor `name` of `gate_proj` / `up_proj` ([I, H] logically) or `down_proj`
        ([H, I]) -> this rank's slice of it, in place (only that slice is read)."""
        local = self.local_expert(e)
        full_units = self.shard.total
        projection = "down_proj" if kind == "down_proj" else "gate_up_proj"
        tensor = self.method.checkpoint_tensor(name, tensor, full_units if kind != "down_proj" else self.hidden)
        full = self._specs(self.method, projection, full_units)[name]
        mine = self._specs(self.method, projection, self.intermediate)[name]
        if tuple(tensor.shape) != tuple(full.shape):
            raise ValueError(f"shape mismatch for {hf_name} -> {expert_param_name(projection, name)}: checkpoint "
                             f"{tuple(tensor.shape)}, model (unsharded) {tuple(full.shape)}")
        param = getattr(self, expert_param_name(projection, name))[local]
        if kind == "down_proj":
            src = _narrow(tensor, mine.in_dim, self.shard.start, mine.in_pack, mine.size_along(mine.in_dim))
            dst = param
        else:
            rows = mine.size_along(mine.out_dim)
            src = _narrow(tensor, mine.out_dim, self.shard.start, mine.out_pack, rows)
            dst = param if mine.out_dim is None else param.narrow(mine.out_dim, 0 if kind == "gate_proj" else rows, rows)
        copy_checked(dst, materialize(src), hf_name)

    def load_fused(self, ours: str, tensor: Any, hf_name: str) -> None:
        """A fused checkpoint tensor of all experts ([E, 2I, H] / [E, H, I] and the method's others, as
        transformers 5 stores them; the float weights also transposed, the Qwen3-VL-MoE hub layout)."""
        projection = "down_proj" if ours.startswith("down_proj") else "gate_up_proj"
        name = next(n for n in self.param_names[projection] if expert_param_name(projection, n) == ours)
        full_units = self.shard.total
        logical_rows = 2 * full_units if projection == "gate_up_proj" else self.hidden
        tensor = materialize(tensor)
        full = self._specs(self.method, projection, full_units)[name]
        full_shape = list(full.shape)
        if projection == "gate_up_proj" and full.out_dim is not None:
            full_shape[full.out_dim] *= 2
        full_shape = (self.num_experts, *full_shape)
        if name == "weight" and tuple(tensor.shape) != full_shape and tensor.dim() == 3 \
                and tuple(tensor.transpose(1, 2).shape) == full_shape:
            tensor = tensor.transpose(1, 2)  # fused experts saved as [E, in, out]
        tensor = torch.stack([self.method.checkpoint_tensor(name, t, logical_rows) for t in tensor]) \
            if tensor.dim() == 3 and name != "weight" else tensor
        if tuple(tensor.shape) != full_shape:
            raise ValueError(f"shape mismatch for {hf_name} -> {ours}: checkpoint {tuple(tensor.shape)}, "
                             f"model (unsharded) {full_shape}")
        tensor = tensor.narrow(0, self.experts.start, self.experts.length)
        mine = self._specs(self.method, projection, self.intermediate)[name]
        s = self.shard
        if projection == "down_proj":
            dim = None if mine.in_dim is None else mine.in_dim + 1
            tensor = _narrow(tensor, dim, s.start, mine.in_pack, mine.size_along(mine.in_dim))
        elif mine.out_dim is not None:
            dim = mine.out_dim + 1
            gate, up = tensor.chunk(2, dim=dim)
            rows = mine.size_along(mine.out_dim)
            tensor = torch.cat([_narrow(half, dim, s.start, mine.out_pack, rows) for half in (gate, up)], dim=dim)
        copy_checked(getattr(self, ours), tensor, hf_name)

    # ------------------------------------------------------------------ forward

    def expert_weight(self, projection: str, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s [out, in] weight of `projection` in `dtype`."""
        params = {name: getattr(self, expert_param_name(projection, name))[local] for name in self.param_names[projection]}
        return self.method.dequantize(params, dtype)

    def stacked_weight(self, projection: str, dtype: torch.dtype) -> torch.Tensor:
        """All local experts' [E_local, out, in] weights of `projection` (an unquantized method: the parameter)."""
        params = {name: getattr(self, expert_param_name(projection, name)) for name in self.param_names[projection]}
        return self.method.dequantize(params, dtype)

    def sync_free(self, rows: int) -> bool:
        """Whether a forward of up to `rows` routed rows (tokens x top-k) reads nothing on the host, so a decode
        of that size can be captured in a CUDA graph: unquantized experts whose projections both take a
        sync-free way of `grouped_linear` (torch's grouped GEMM where it runs sync-free, CUDA bfloat16 on
        compute capability 9.x / 10.x and the CPU; else the gathered fallback within its budget). LoRA on
        the experts takes the same ways (the engine captures no graphs with LoRA)."""
        if self.method.quantized:
            return False
        weight = self.gate_up_proj  # [E_local, 2I, H]
        return (runs_sync_free(rows, self.hidden, 2 * self.intermediate, weight.device, weight.dtype)
                and runs_sync_free(rows, self.intermediate, self.hidden, weight.device, weight.dtype))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids, weights: [T, k] -> [T, H]
        routed = RoutedRows.sort(expert_ids, weights, self.experts.start, self.experts.length, self.num_experts)
        if not self.method.quantized:
            out = self._forward_grouped(x, routed)
            if out is not None:
                return out
        return self._forward_per_expert(x, routed)

    def _forward_grouped(self, x: torch.Tensor, routed: RoutedRows) -> Optional[torch.Tensor]:
        """Every assignment at once, no host sync (`grouped_linear`; LoRA on the experts likewise,
        `ExpertsLoRA.add_grouped`); None where that does not fit."""
        adapters = None if self.lora is None else self.lora.rows(routed)  # LoRA: the rows' slots, once
        xs = x.index_select(0, routed.tokens)  # [N, H], sorted by expert
        h = grouped_linear(xs, self.stacked_weight("gate_up_proj", x.dtype), routed)  # [N, 2I]
        if h is not None and adapters is not None:
            h = self.lora.add_grouped("gate_up_proj", xs, h, adapters)
        if h is None:
            return None
        gate, up = h.chunk(2, dim=-1)  # [N, I] each
        inner = self.act_fn(gate) * up
        y = grouped_linear(inner, self.stacked_weight("down_proj", x.dtype), routed)  # [N, H]
        if y is not None and adapters is not None:
            y = self.lora.add_grouped("down_proj", inner, y, adapters)
        if y is None:
            return None
        if routed.local is not None:  # another rank's experts: no contribution here
            y = torch.where(routed.local[:, None], y, 0.0)
        return routed.combine(y)  # [T, H]: weighted, each token's experts summed in expert order, as the loop does

    def _forward_per_expert(self, x: torch.Tensor, routed: RoutedRows) -> torch.Tensor:
        """The loop over experts: one gathered matmul pair per expert that received tokens, after reading the
        per-expert counts on the host (a sync on CUDA). Runs for quantized experts (each dequantized alone)
        and batches too large for `grouped_linear`'s gathered fallback (LoRA on the experts: one expert's
        rows at a time, `ExpertsLoRA.add`)."""
        out = torch.zeros_like(x)
        ends = routed.ends.tolist()  # the host sync
        start = 0
        for local, end in enumerate(ends):
            if end == start:
                continue
            tokens = routed.tokens[start:end]  # [n]
            scale = routed.weights[start:end, None]
            start = end
            adapters = None if self.lora is None else self.lora.select(tokens)  # LoRA: the tokens' slots, once
            gate_up = self.expert_weight("gate_up_proj", local, x.dtype)  # [2I, H]
            xs = x[tokens]  # [n, H]
            h = F.linear(xs, gate_up)  # [n, 2I]
            if adapters is not None:
                h = self.lora.add("gate_up_proj", local, xs, h, adapters)
            gate, up = h.chunk(2, dim=-1)  # [n, I] each
            inner = self.act_fn(gate) * up
            y = F.linear(inner, self.expert_weight("down_proj", local, x.dtype))  # [n, H]
            if adapters is not None:
                y = self.lora.add("down_proj", local, inner, y, adapters)
            # (index_put_ accumulating: the same sums, each token once per expert; index_add_ took ~60 ms a call
            # on the 2-core CPU whatever its size, torch 2.14, under load)
            out.index_put_((tokens,), y * scale, accumulate=True)
        return out


PROJECTIONS = ("gate_up_proj", "down_proj")


def _narrow(tensor: Any, dim: Optional[int], start: int, pack: int, length: int) -> Any:
    """This rank's `length` stored elements along `dim` from feature `start` (whole when that is all of it)."""
    if dim is None or (start == 0 and length == tensor.shape[dim]):
        return tensor
    return tensor.narrow(dim, start // pack, length)


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
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)  # the router: replicated
        self.experts = FusedExperts(num_experts, hidden, moe_intermediate, act, tp)
        self.shared_expert: Optional[SwiGLUMLP] = None
        if shared_intermediate > 0:
            self.shared_expert = SwiGLUMLP(hidden, shared_intermediate, act, tp=tp, reduce=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def step_capturable(self, num_tokens: int) -> bool:
        """Whether a decode step of up to `num_tokens` tokens runs this block with no host read (CUDA graphs)."""
        return self.experts.sync_free(num_tokens * self.top_k)

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
