"""The adapters' tensors inside the model and the batched low-rank update.

Every linear layer (`vlmrun.layers.linear.LinearBase`) and every MoE experts block
(`vlmrun.layers.moe.FusedExperts`) gets a `lora` object here (`attach_lora`); its slot tensors are
made the first time an adapter that adapts the layer is written to a slot, so an untargeted layer
costs one attribute check per call. A linear layer keeps, per slot,

    a [blocks * rank, in_local] and b [out_local, blocks * rank] (the scaling folded into b),

where the blocks are its checkpoint parts (q | k | v, gate | up; one block for an unfused layer): part
p's A fills rows [p * rank, p * rank + r) of a, its B those columns of its own output rows of b, so
delta = (x @ a.T) @ b.T is every part's update in two matmuls. A rank below the slot's is zero-padded. Rows of different
adapters run as one pair of matmuls over all slots, each row keeping its own slot's share
(`low_rank_update`): a gathered batched LoRA matmul in torch ops, no per-row gather or scatter.

With `lora_kernel="triton"` (CUDA, opt-in) a batch of mixed adapters carries its rows grouped by slot
instead (`triton_ops.SlotGroups`) and two Triton kernels add each row's own slot's update (`triton_ops`).

`LoRABatch` holds the rows' slots of one forward; `LoRAContext` holds the batch of the forward that
runs now. The model runner (text tokens) and the vision stage (patches) set it before each model
call; it belongs to one model (`LoRAManager`), never to a module-global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

NO_ADAPTER = -1  # a row's slot when it runs the base model alone


@dataclass
class LoRABatch:
    """The adapter slot of each row of one forward.

    `single`: the slot when every row has the same adapter (the update is two plain matmuls); otherwise
    `onehot` [num_rows, slots] (1 at each row's slot, a row of zeros for the base model) keeps, of the
    update of every slot, each row's own: one pair of matmuls over all slots, no gather or scatter.
    With the Triton kernel, `groups` (`triton_ops.SlotGroups`) replaces `onehot`: the rows grouped by slot."""

    single: Optional[int] = None
    onehot: Optional[torch.Tensor] = None  # [num_rows, slots] in the model's dtype (None when `single`)
    groups: Optional[Any] = None  # `triton_ops.SlotGroups` (lora_kernel="triton", several slots), else None

    def onehot_rows(self, n: int) -> torch.Tensor:
        """`onehot` for a forward of n >= num_rows rows: a padded decode's extra rows (after the real ones)
        get no adapter. Kept padded, so the experts of the same forward index their tokens in it."""
        if self.onehot.shape[0] < n:
            self.onehot = torch.nn.functional.pad(self.onehot, (0, 0, 0, n - self.onehot.shape[0]))
        return self.onehot

    @classmethod
    def of_spans(cls, slots: Sequence[int], lengths: Sequence[int], num_slots: int, device: torch.device,
                 dtype: torch.dtype, kernel: str = "torch") -> Optional["LoRABatch"]:
        """Spans of `lengths[i]` consecutive rows running slot `slots[i]`; None when no span has an adapter.
        `kernel`: "torch" (the masked update) or "triton" (the rows grouped by slot for `triton_ops`)."""
        if all(s == NO_ADAPTER for s in slots):
            return None
        row_slots = torch.repeat_interleave(torch.tensor(list(slots), dtype=torch.int64),
                                            torch.tensor(list(lengths), dtype=torch.int64))  # [num_rows]
        if len(set(slots)) == 1:
            return cls(single=slots[0])
        if kernel == "triton":
            from vlmrun.lora.triton_ops import SlotGroups

            return cls(groups=SlotGroups.of_spans(slots, lengths, num_slots, device))
        onehot = torch.zeros(len(row_slots), num_slots + 1, dtype=dtype)  # column num_slots: the base model's
        onehot[torch.arange(len(row_slots)), row_slots.where(row_slots >= 0, num_slots)] = 1
        return cls(onehot=onehot[:, :num_slots].to(device))


class LoRAContext:
    """The adapter slots of the rows of the forward that runs now (None: no row has an adapter)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


def low_rank_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                    rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [n, out] + each row's slot's (x @ A.T) @ B.T, with a [slots, k, in] and b [out, slots, k] (a slot's
    k = its blocks * rank); `rows` [n]: the forward's rows x holds (all of them, in order, when None)."""
    if batch.single is not None:
        return torch.addmm(y, x @ a[batch.single].T, b[:, batch.single].T)
    slots, k, n_in = a.shape
    onehot = batch.onehot_rows(x.shape[0]) if rows is None else batch.onehot[rows]  # [n, slots]
    xa = (x @ a.view(slots * k, n_in).T).view(-1, slots, k) * onehot[:, :, None]  # [n, slots, k]: own slot's only
    return torch.addmm(y, xa.view(-1, slots * k), b.view(-1, slots * k).T)


class LinearLoRA:
    """One linear layer's adapters, one per slot: y += (x @ a[slot].T) @ b[:, slot].T on that slot's rows."""

    def __init__(self, context: LoRAContext, num_slots: int, blocks: int, max_rank: int, in_features: int,
                 out_features: int, device: torch.device, dtype: torch.dtype):
        self.context = context
        self.shape = (num_slots, blocks * max_rank, in_features, out_features)
        self.device, self.dtype = device, dtype
        self.a: Optional[torch.Tensor] = None  # [slots, blocks * rank, in_local], made on first use
        self.b: Optional[torch.Tensor] = None  # [out_local, slots, blocks * rank]
        self.filled = [False] * num_slots

    def write(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
        """Slot `slot` <- an adapter's (a [k, in], b [out, k]) for this layer, or zeros (None: the adapter
        leaves the layer alone)."""
        if a is None and self.a is None:
            return
        if self.a is None:
            slots, k, n_in, n_out = self.shape
            self.a = torch.zeros(slots, k, n_in, device=self.device, dtype=self.dtype)
            self.b = torch.zeros(n_out, slots, k, device=self.device, dtype=self.dtype)
        if a is None:
            self.a[slot].zero_()
            self.b[:, slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[:, slot].copy_(b)
        self.filled[slot] = a is not None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [.., out] + the update of each row's adapter (x [.., in])."""
        batch = self.context.batch
        if batch is None or self.a is None or (batch.single is not None and not self.filled[batch.single]):
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])  # [n, in], [n, out]
        if batch.groups is not None:
            from vlmrun.lora.triton_ops import add_to_rows

            return add_to_rows(x2, y2, self.a, self.b, batch.groups).view(y.shape)
        return low_rank_update(x2, y2, self.a, self.b, batch).view(y.shape)


PROJECTIONS = ("gate_up_proj", "down_proj")


class ExpertsLoRA:
    """A fused experts block's adapters: per projection a [E_local, slots, rank, in], b [E_local, out, slots, rank]."""

    def __init__(self, context: LoRAContext, num_slots: int, max_rank: int, num_local_experts: int,
                 shapes: dict[str, tuple[int, int]], device: torch.device, dtype: torch.dtype):
        self.context = context
        self.num_slots, self.max_rank, self.num_local_experts = num_slots, max_rank, num_local_experts
        self.shapes = shapes  # projection -> (out_local, in_local) of one expert
        self.device, self.dtype = device, dtype
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.filled = {p: [False] * num_slots for p in PROJECTIONS}

    def write(self, slot: int, projection: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
        """Slot `slot` of `projection` <- (a [E_local, rank, in], b [E_local, out, rank]), or zeros (None)."""
        if a is None and projection not in self.a:
            return
        if projection not in self.a:
            out, n_in = self.shapes[projection]
            e, s, r = self.num_local_experts, self.num_slots, self.max_rank
            self.a[projection] = torch.zeros(e, s, r, n_in, device=self.device, dtype=self.dtype)
            self.b[projection] = torch.zeros(e, out, s, r, device=self.device, dtype=self.dtype)
        if a is None:
            self.a[projection][:, slot].zero_()
            self.b[projection][:, :, slot].zero_()
        else:
            self.a[projection][:, slot].copy_(a)
            self.b[projection][:, :, slot].copy_(b)
        self.filled[projection][slot] = a is not None

    def add(self, projection: str, local: int, x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
            num_rows: int) -> torch.Tensor:
        """y [n, out] + each routed token's adapter update for expert `local` (x [n, in]; tokens [n]: the
        rows, of the forward's `num_rows`, the n assignments belong to)."""
        batch = self.context.batch
        if batch is None or projection not in self.a \
                or (batch.single is not None and not self.filled[projection][batch.single]):
            return y
        if batch.groups is not None:
            from vlmrun.lora.triton_ops import add_to_token_rows

            return add_to_token_rows(x, y, self.a[projection][local], self.b[projection][local], batch.groups,
                                     tokens, num_rows)
        if batch.single is None:
            batch.onehot_rows(num_rows)  # a padded decode's rows: covered before indexing by token
        return low_rank_update(x, y, self.a[projection][local], self.b[projection][local], batch, tokens)


def attach_lora(model: nn.Module, context: LoRAContext, num_slots: int, max_rank: int,
                device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Gives every linear layer and experts block of `model` its (empty) adapter slots; name -> them."""
    from vlmrun.layers.linear import LinearBase
    from vlmrun.layers.moe import FusedExperts

    targets: dict[str, object] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            blocks = max(1, len(module.part_names))
            module.lora = LinearLoRA(context, num_slots, blocks, max_rank, module.in_features, module.out_features,
                                     device, dtype)
        elif isinstance(module, FusedExperts):
            shapes = {"gate_up_proj": (2 * module.intermediate, module.hidden),
                      "down_proj": (module.hidden, module.intermediate)}
            module.lora = ExpertsLoRA(context, num_slots, max_rank, module.experts.length, shapes, device, dtype)
        else:
            continue
        targets[name] = module.lora
    return targets
