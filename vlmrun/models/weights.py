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

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from vlmrun.layers.linear import LinearBase, copy_checked, fused_part_aliases
from vlmrun.layers.moe import PER_EXPERT_TENSOR, FusedExperts
from vlmrun.loader import materialize
from vlmrun.parallel import SINGLE, TensorParallel


def build_model(cls: Callable[..., nn.Module], config: Any, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE, prepare: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """`cls(config, tp)` with empty parameters in `dtype` (floating ones, but for those a layer keeps in
    its own dtype: `stored_dtypes`) on `device`; tied ones stay tied. `prepare(model)` runs before the
    storage is made (the quantized layers' methods are assigned there)."""
    with torch.device("meta"):
        model = cls(config, tp)
        if prepare is not None:
            prepare(model)
    storage: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in storage:
                kept = getattr(module, "stored_dtypes", {}).get(name)  # a quantized format's own dtype
                kind = kept or (dtype if param.is_floating_point() else param.dtype)
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


def finish_loading(model: nn.Module) -> None:
    """Each linear layer's method rearranges its loaded tensors once (`LinearMethod.after_loading`); any other
    module with an `after_loading()` (e.g. the dense attention's joint q/k norm weight) makes what it derives
    from its final weights."""
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedExperts)):
            module.method.after_loading(module)
        elif callable(getattr(module, "after_loading", None)):
            module.after_loading()


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take on its device (a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


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
    aliases = fused_part_aliases(module)
    loaded: set[str] = set()
    expert_pieces: dict[str, set[tuple[int, str]]] = {}  # fused param -> (expert, kind) pieces seen
    part_pieces: dict[str, set[int]] = {}  # fused-part param -> parts seen
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        name, part = aliases.get(name, (name, None))
        if name in owners and name in params:
            owner, local = owners[name]
            if hasattr(owner, "checkpoint_tensor"):  # the layer's method may rearrange it first (FP8 scales)
                tensor = owner.checkpoint_tensor(local, tensor, part)
            if transform is not None:
                tensor = transform(name, tensor)
            owner.load_weight(local, tensor, part, hf_name)
            if part is None:
                loaded.add(name)
            else:
                part_pieces.setdefault(name, set()).add(part)
            continue
        m = PER_EXPERT_TENSOR.match(name)
        experts = _fused_experts(module, m["prefix"]) if m else None
        if experts is not None:
            target = f"{m['prefix']}.{experts.piece_target(m['kind'], m['name'])}"
            if target not in params:
                continue
            e = int(m["e"])
            if e >= experts.num_experts:
                raise ValueError(f"{hf_name}: expert {e} out of range, the model has {experts.num_experts} experts")
            if experts.local_expert(e) is None:  # another rank's expert (expert parallel)
                continue
            experts.load_piece(m["kind"], m["name"], tensor, e, hf_name)  # reads only this rank's slice
            expert_pieces.setdefault(target, set()).add((e, m["kind"]))
            continue
        if name not in params:
            continue
        owner_name, _, local = name.rpartition(".")
        experts = _fused_experts(module, owner_name)
        if experts is not None:
            experts.load_fused(local, tensor, hf_name)
            loaded.add(name)
            continue
        tensor = materialize(tensor)  # read whole: a replicated parameter
        if transform is not None:
            tensor = transform(name, tensor)
        _copy(params[name], tensor, hf_name, name)
        loaded.add(name)
    for target, pieces in expert_pieces.items():
        mine = module.get_submodule(target.rpartition(".")[0]).experts  # this rank's experts
        kinds = ("down_proj",) if target.rpartition(".")[2].startswith("down_proj") else ("gate_proj", "up_proj")
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


def _fused_experts(module: nn.Module, name: str) -> Optional[FusedExperts]:
    """The FusedExperts module called `name` in `module`, None when there is none."""
    try:
        sub = module.get_submodule(name)
    except AttributeError:
        return None
    return sub if isinstance(sub, FusedExperts) else None


def _sharded_owners(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Parameter name -> (the module that loads it itself, its local name), for modules with `load_weight`."""
    owners = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "load_weight"):
            for local, param in sub._parameters.items():
                if param is not None:
                    owners[f"{prefix}.{local}" if prefix else local] = (sub, local)
    return owners


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch for {hf_name} -> {name}: checkpoint {tuple(src.shape)}, "
                         f"model {tuple(dst.shape)}")
    copy_checked(dst, src, hf_name)
