"""A read adapter (`peft_files.PeftAdapter`) laid out for one model on one rank: `map_adapter`.

Each adapted HF module is found the way the checkpoint loader finds its weight: the model's
`checkpoint_name(module + ".weight")`, then the fused-part aliases (`q_proj` -> part 0 of
`qkv_proj`). Its A / B are checked against the layer's full (unsharded) shape and cut like the base
weight: a column-parallel layer keeps B's rows of this rank's output shard of each part, a
row-parallel layer A's columns of its input shard (its partial sums meet in the layer's all-reduce);
the MoE experts keep this rank's experts and expert units. B is scaled by PEFT's scaling once, here.
A model whose checkpoint orders a layer's output rows otherwise regroups B's rows the same way
(`Model.lora_output_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.layers.linear import LinearBase, fused_part_aliases
from vlmrun.layers.moe import FusedExperts
from vlmrun.lora.peft_files import LoRAError, ModuleLoRA, PeftAdapter


@dataclass
class MappedAdapter:
    """An adapter's tensors for this model and rank, on the host, ready to copy into a slot."""

    name: str
    rank: int  # the largest module rank
    linear: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (a, b) slot-shaped
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # layer -> proj -> (a, b)
    vision: bool = False  # it adapts a layer of the vision tower (image embeddings depend on it)


def map_adapter(model: nn.Module, adapter: PeftAdapter, max_rank: int, dtype: torch.dtype) -> MappedAdapter:
    """The adapter's slot tensors for `model` (this rank's shards); LoRAError naming the adapter and the
    module for a module the model lacks, a shape that is not the base layer's or a rank over `max_rank`."""
    out = MappedAdapter(adapter.name, rank=0)
    aliases = fused_part_aliases(model)

    def fail(module: str, what: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {adapter.name!r}: {module}: {what}")

    for module, loras in adapter.modules.items():
        ours = model.checkpoint_name(module + ".weight")
        param, part = aliases.get(ours, (ours, None)) if ours is not None else ("", None)
        layer_name = param.rpartition(".")[0]
        layer = _submodule(model, layer_name) if layer_name else None
        if isinstance(layer, FusedExperts):
            for lora in loras:
                projection, rank = _expert_projection(layer, lora, lambda what: fail(module, what))
                _check_rank(fail, module, rank, max_rank)
                scaling = adapter.scaling(f"{module}.{projection}", rank)
                out.experts.setdefault(layer_name, {})[projection] = _place_experts(
                    layer, projection, lora, rank, scaling, max_rank, dtype)
                out.rank = max(out.rank, rank)
            continue
        if not isinstance(layer, LinearBase) or len(loras) != 1:
            raise fail(module, "no linear layer of this model has that name (only the model's linear layers "
                               "and MoE experts take adapters; not embeddings or the LM head)")
        lora, rank = loras[0], loras[0].a.shape[0]
        _check_rank(fail, module, rank, max_rank)
        a, b = out.linear.get(layer_name) or _empty_linear(layer, max_rank, dtype)
        _place_linear(model, layer, layer_name, part, lora, adapter.scaling(module, rank), a, b, max_rank,
                      lambda what: fail(module, what))
        out.linear[layer_name] = (a, b)
        out.rank = max(out.rank, rank)
        out.vision |= layer_name.startswith("visual.")
    _check_finite(adapter, out, dtype)
    return out


def _check_finite(adapter: PeftAdapter, out: MappedAdapter, dtype: torch.dtype) -> None:
    """LoRAError naming the layer when a slot tensor is NaN or inf: the read tensors are finite, but B times
    PEFT's scaling (or either in `dtype`) may overflow; such a slot would turn its rows' outputs to NaN."""
    tensors = [(name, pair) for name, pair in out.linear.items()]
    tensors += [(f"{name}.{projection}", pair) for name, pairs in out.experts.items() for projection, pair in pairs.items()]
    for name, (a, b) in tensors:
        for which, t in (("A", a), ("B", b)):
            if not torch.isfinite(t).all():
                raise LoRAError(f"LoRA adapter {adapter.name!r}: {name}: scaled by lora_alpha / r, {which} of the "
                                f"layer is not finite in {str(dtype).removeprefix('torch.')} (lora_alpha="
                                f"{adapter.lora_alpha:g}, alpha_pattern={adapter.alpha_pattern})")


def _submodule(model: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _check_rank(fail: Any, module: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise fail(module, f"rank {rank} is over max_lora_rank={max_rank}")


def _empty_linear(layer: LinearBase, max_rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = max(1, len(layer.part_names))
    return (torch.zeros(blocks * max_rank, layer.in_features, dtype=dtype),
            torch.zeros(layer.out_features, blocks * max_rank, dtype=dtype))


def _place_linear(model: nn.Module, layer: LinearBase, layer_name: str, part: Optional[int], lora: ModuleLoRA,
                  scaling: float, a: torch.Tensor, b: torch.Tensor, max_rank: int, fail: Any) -> None:
    """Writes one module's A / B into the layer's slot tensors `a` [blocks * R, in_local] and `b`
    [out_local, blocks * R]: its block (the part, or 0), this rank's input columns and output rows."""
    rank = lora.a.shape[0]
    full_in, full_out = layer.in_shard.total, layer.part_rows(part)
    if tuple(lora.a.shape) != (rank, full_in) or tuple(lora.b.shape) != (full_out, rank):
        raise fail(f"lora_A {tuple(lora.a.shape)} / lora_B {tuple(lora.b.shape)} do not fit the base layer "
                   f"[{full_out}, {full_in}] (an adapter of another model?)")
    lora_b = model.lora_output_rows(layer_name, lora.b) * scaling  # [full_out, rank]
    block = part or 0
    cols = slice(block * max_rank, block * max_rank + rank)
    a[cols] = lora.a.narrow(1, layer.in_shard.start, layer.in_shard.length)
    parts = range(len(layer.out_shards)) if part is None else [part]
    src = 0
    for p in parts:
        shard = layer.out_shards[p]
        dst = sum(layer.out_shards[q].length for q in range(p))
        b[dst:dst + shard.length, cols] = lora_b[src + shard.start:src + shard.start + shard.length]
        src += shard.total


def _expert_projection(experts: FusedExperts, lora: ModuleLoRA, fail: Any) -> tuple[str, int]:
    """Which fused projection a `target_parameters` pair adapts, told by its shapes, and its rank."""
    e, hidden, units = experts.num_experts, experts.hidden, experts.shard.total
    if lora.a.shape[0] % e:
        raise fail(f"lora_A has {lora.a.shape[0]} rows, not a multiple of the model's {e} experts")
    rank = lora.a.shape[0] // e
    if lora.a.shape[1] == hidden and lora.b.shape[0] == 2 * units:
        return "gate_up_proj", rank
    if lora.a.shape[1] == units and lora.b.shape[0] == hidden:
        return "down_proj", rank
    raise fail(f"lora_A {tuple(lora.a.shape)} / lora_B {tuple(lora.b.shape)} fit neither the experts' gate_up_proj "
               f"[{e}, {2 * units}, {hidden}] nor down_proj [{e}, {hidden}, {units}]")


def _place_experts(experts: FusedExperts, projection: str, lora: ModuleLoRA, rank: int, scaling: float,
                   max_rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's expert layout (A [r * E, in] as [E, r, in]; B [out, r * E] as [out, r, E]) -> this rank's
    a [E_local, R, in_local], b [E_local, out_local, R], scaled, the rank zero-padded to R."""
    e = experts.num_experts
    a = lora.a.reshape(e, rank, -1)  # [E, r, in]
    b = lora.b.reshape(lora.b.shape[0], rank, e).permute(2, 0, 1) * scaling  # [E, out, r]
    mine, s = experts.experts, experts.shard
    a, b = a[mine.start:mine.start + mine.length], b[mine.start:mine.start + mine.length]
    if projection == "gate_up_proj":  # gate rows then up rows, each cut to this rank's units
        gate, up = b.chunk(2, dim=1)
        b = torch.cat([gate[:, s.start:s.start + s.length], up[:, s.start:s.start + s.length]], dim=1)
    else:
        a = a[:, :, s.start:s.start + s.length]
    a_out = torch.zeros(a.shape[0], max_rank, a.shape[2], dtype=dtype)
    b_out = torch.zeros(b.shape[0], b.shape[1], max_rank, dtype=dtype)
    a_out[:, :rank] = a
    b_out[:, :, :rank] = b
    return a_out, b_out
