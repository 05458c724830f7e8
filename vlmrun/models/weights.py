"""Weights into a model: building it on its device in its dtype, and the one checkpoint loader.

`build_model(cls, config, dtype, device, tp)` constructs a model on the meta device (no memory, and
no process-wide default-dtype switch), then gives every parameter its storage once, empty, in
`dtype` on `device`; buffers (made on the CPU at construction, e.g. rotary frequencies) move to
`device` as they are. The checkpoint then fills every parameter: `load_checkpoint` refuses to
leave one unset, so no uninitialised storage survives.

`load_checkpoint(module, weights, rename, transform=None)` copies HF-named tensors into the
parameters. MoE expert weights are taken fused (`experts.gate_up_proj` [E, 2I, H] /
`experts.down_proj` [E, H, I], as transformers 5 stores them), fused but transposed
([E, H, 2I] / [E, I, H], the Qwen3-VL-MoE hub layout), or per expert (`experts.{e}.gate_proj.weight`
[I, H], `up_proj` [I, H], `down_proj` [H, I], the hub layout of the others).

A module with a `load_weight(name, tensor, part, hf_name)` method (the tensor-parallel layers of
`vlmrun.layers.linear`) loads its own parameters from the full checkpoint tensor, keeping this
rank's slice; a fused one names the checkpoint tensors of its parts (`part_names`), and a
parameter counts as loaded once every part arrived. Tensors may come lazily
(`vlmrun.loader.LazyTensor`): only sharded layers read them in slices, the rest reads them whole.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from vlmrun.loader import materialize
from vlmrun.parallel import SINGLE, TensorParallel


def build_model(cls: Callable[..., nn.Module], config: Any, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE) -> nn.Module:
    """`cls(config, tp)` with empty parameters in `dtype` (floating ones) on `device`; tied ones stay tied."""
    with torch.device("meta"):
        model = cls(config, tp)
    storage: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in storage:
                kind = dtype if param.is_floating_point() else param.dtype
                storage[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                  requires_grad=False)
            module._parameters[name] = storage[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.is_meta:
                raise RuntimeError(f"{type(module).__name__}.{name}: a buffer made on the default device; "
                                   f"create it with device='cpu'")
            module._buffers[name] = buffer.to(device)
    return model


_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = ("experts.gate_up_proj", "experts.down_proj")

Rename = Callable[[str], Optional[str]]
Transform = Callable[[str, torch.Tensor], torch.Tensor]


def load_checkpoint(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename, *,
                    transform: Optional[Transform] = None) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters; MoE expert layouts are converted on the way.

    `rename(hf_name)` gives our parameter name (per-expert names keep their `experts.{e}.*` tail) or
    None to skip; `transform(our_name, tensor)` may rearrange a tensor before the copy (e.g. reorder
    fused projection rows). A tensor whose shape fits neither the parameter nor (for fused experts)
    its transpose raises, naming it; so does any parameter the checkpoint leaves unset. Returns the
    set of loaded parameter names.
    """
    params = dict(module.named_parameters())
    owners = _sharded_owners(module)
    aliases = _fused_part_aliases(module)
    loaded: set[str] = set()
    expert_pieces: dict[str, set[tuple[int, str]]] = {}  # fused param -> (expert, kind) pieces seen
    part_pieces: dict[str, set[int]] = {}  # fused-part param -> parts seen
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        name, part = aliases.get(name, (name, None))
        if name in owners and name in params:
            if transform is not None:
                tensor = transform(name, tensor)
            owner, local = owners[name]
            owner.load_weight(local, tensor, part, hf_name)
            if part is None:
                loaded.add(name)
            else:
                part_pieces.setdefault(name, set()).add(part)
            continue
        m = _PER_EXPERT.match(name)
        if m:
            kind = m["kind"]
            target = f"{m['prefix']}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
            if target not in params:
                continue
            param, e = params[target], int(m["e"])
            experts = module.get_submodule(m["prefix"])
            if e >= experts.num_experts:
                raise ValueError(f"{hf_name}: expert {e} out of range, the model has {experts.num_experts} experts")
            local = experts.local_expert(e)
            if local is None:  # another rank's expert (expert parallel)
                continue
            half = param.shape[1] // 2
            dst = {"gate_proj": param[local, :half], "up_proj": param[local, half:], "down_proj": param[local]}[kind]
            full = experts.full_shape(target.rpartition(".")[2])[1:]
            piece = full if kind == "down_proj" else (full[0] // 2, full[1])  # [H, I] or [I, H]
            if tuple(tensor.shape) != piece:
                raise ValueError(f"shape mismatch for {hf_name} -> {target}: checkpoint {tuple(tensor.shape)}, "
                                 f"model (unsharded) {piece}")
            _copy(dst, experts.shard_piece(kind, tensor), hf_name, target)  # reads only this rank's slice
            expert_pieces.setdefault(target, set()).add((e, kind))
            continue
        if name not in params:
            continue
        param = params[name]
        tensor = materialize(tensor)  # read whole: a replicated parameter or fused experts
        if transform is not None:
            tensor = transform(name, tensor)
        if name.endswith(_FUSED):
            experts, _, local = name.rpartition(".")
            experts = module.get_submodule(experts)
            full = experts.full_shape(local)
            if tensor.shape != full and tensor.dim() == 3 and tensor.transpose(1, 2).shape == full:
                tensor = tensor.transpose(1, 2)  # fused experts saved as [E, in, out]
            if tensor.shape == full:
                tensor = experts.shard_full(local, tensor)
        _copy(param, tensor, hf_name, name)
        loaded.add(name)
    for target, pieces in expert_pieces.items():
        mine = module.get_submodule(target.rpartition(".")[0]).experts  # this rank's experts
        kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        absent = [f"{e}.{k}" for e in range(mine.start, mine.start + mine.length) for k in kinds
                  if (e, k) not in pieces]
        if absent:
            shown = ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else "")
            raise ValueError(f"{target}: the checkpoint lacks {len(absent)} per-expert weights: experts.{shown}")
        loaded.add(target)
    for name, parts in part_pieces.items():
        owner, _ = owners[name]
        if len(parts) == len(owner.part_names):
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} parameters missing from the checkpoint: {shown}")
    return loaded


def _sharded_owners(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Parameter name -> (the module that loads it itself, its local name), for modules with `load_weight`."""
    owners = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "load_weight"):
            for local, param in sub._parameters.items():
                if param is not None:
                    owners[f"{prefix}.{local}" if prefix else local] = (sub, local)
    return owners


def _fused_part_aliases(module: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint-style name of a fused part (`...self_attn.q_proj.weight`) -> (our parameter, part index)."""
    aliases = {}
    for prefix, sub in module.named_modules():
        parent = prefix.rpartition(".")[0]
        for i, part in enumerate(getattr(sub, "part_names", ())):
            for local, param in sub._parameters.items():
                if param is not None:
                    ours = f"{prefix}.{local}" if prefix else local
                    aliases[f"{parent}.{part}.{local}" if parent else f"{part}.{local}"] = (ours, i)
    return aliases


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch for {hf_name} -> {name}: checkpoint {tuple(src.shape)}, "
                         f"model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
