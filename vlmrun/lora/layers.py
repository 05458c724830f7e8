"""The adapters' tensors inside the model and the batched low-rank update.

Every linear layer (`vlmrun.layers.linear.LinearBase`) and every MoE experts block
(`vlmrun.layers.moe.FusedExperts`) gets a `lora` object here (`attach_lora`); its slot tensors are
made the first time an adapter that adapts the layer is written to a slot, so an untargeted layer
costs one attribute check per call. A linear layer keeps, per slot,

    a [blocks * rank, in_local] and b [out_local, blocks * rank] (the scaling folded into b),

where the blocks are its checkpoint parts (q | k | v, gate | up; one block for an unfused layer): part
p's A fills rows [p * rank, p * rank + r) of a, its B those columns of its own output rows of b, so
delta = (x @ a.T) @ b.T is every part's update in two matmuls. A rank below the slot's is zero-padded. Rows of different
adapters run one pair of matmuls per slot present, on that slot's rows only (gathered by index, updated
with the addmm a batch of that adapter alone runs, copied back: `low_rank_update`); an experts block's
routed tokens, whose slots are known on the device only, keep each slot's result by torch.where. A row
never meets another slot's values: multiplying the other slots' results by a 0/1 mask, as this did, made
0 x NaN = NaN, so one adapter's non-finite values (or a row's x @ A of another slot overflowing) reached
every row. What one row's adapter makes stays in that row.

With `lora_kernel="triton"` (CUDA, opt-in) a batch of mixed adapters carries its rows grouped by slot
instead (`triton_ops.SlotGroups`) and two Triton kernels add each row's own slot's update (`triton_ops`).

`LoRABatch` holds the rows' slots of one forward; `LoRAContext` holds the batch of the forward that
runs now. The model runner (text tokens) and the vision stage (patches) set it before each model
call, and the manager pads it once to the forward's rows as the model starts (a padded decode's extra
rows); it belongs to one model (`LoRAManager`), never to a module-global. An experts block adds every
routed row's update at once (`ExpertsLoRA.add_grouped`: grouped matmuls as the experts' own, the rows
regrouped by (slot, expert) on the device for a mixed batch, no host read, whichever `lora_kernel`); its
per-expert loop (quantized experts) takes, once per expert, the batch of its routed tokens
(`LoRABatch.select`) for both projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from vlmrun.host_to_device import upload
from vlmrun.layers.grouped_matmul import Segments, grouped_linear

NO_ADAPTER = -1  # a row's slot when it runs the base model alone


@dataclass(frozen=True)
class LoRABatch:
    """The adapter slot of each row of one forward (or of an expert's routed tokens: `select`).

    `single`: the slot when every row has the same adapter (the update is two plain matmuls); otherwise
    `slots` (the distinct slots the rows run, base-model rows aside) and, per slot, its rows: `rows[i]`
    (their indices, known on the host when the rows are bound: each slot's update runs on its own rows,
    gathered) or, for an expert's routed tokens (`select`, rows known on the device only), `owns[i]` (a
    mask: the update runs over all rows and is kept on the slot's only). With the Triton kernel, `groups`
    (`triton_ops.SlotGroups`) replaces them: the rows grouped by slot."""

    single: Optional[int] = None
    slots: tuple[int, ...] = ()  # the slots of a mixed batch's rows (host ints), without NO_ADAPTER
    owns: Optional[torch.Tensor] = None  # [len(slots), num_rows, 1] bool: row r runs slots[i] (None when `single`)
    rows: Optional[tuple[torch.Tensor, ...]] = None  # per slot [its rows] int64; None for an expert's tokens
    groups: Optional[Any] = None  # `triton_ops.SlotGroups` (lora_kernel="triton", several slots), else None
    row_slots: Optional[torch.Tensor] = None  # [num_rows] int64 on the device, each row's slot (NO_ADAPTER: none)

    @classmethod
    def of_spans(cls, slots: Sequence[int], lengths: Sequence[int], num_slots: int, device: torch.device,
                 dtype: torch.dtype, kernel: str = "torch") -> Optional["LoRABatch"]:
        """Spans of `lengths[i]` consecutive rows running slot `slots[i]`; None when no span has an adapter.
        `kernel`: "torch" (an update per slot, selected by row) or "triton" (the rows grouped by slot for `triton_ops`).
        Built on the host, one upload (`vlmrun.host_to_device.upload`)."""
        if all(s == NO_ADAPTER for s in slots):
            return None
        if len(set(slots)) == 1:
            return cls(single=slots[0])
        if kernel == "triton":
            from vlmrun.lora.triton_ops import SlotGroups

            return cls(groups=SlotGroups.of_spans(slots, lengths, num_slots, device))
        row_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                            torch.tensor(lengths, dtype=torch.int64))  # [num_rows]
        present = tuple(sorted(set(slots) - {NO_ADAPTER}))
        owns = row_slots[None, :, None] == torch.tensor(present)[:, None, None]  # [len(present), num_rows, 1]
        rows = [owns[i, :, 0].nonzero().flatten() for i in range(len(present))]
        flat = upload(torch.cat([row_slots, owns.flatten().to(torch.int64), *rows]), device)  # one upload
        n = row_slots.shape[0]
        owns_dev = flat[n:n + owns.numel()].view(owns.shape).bool()
        ends = torch.tensor([n + owns.numel()] + [len(r) for r in rows]).cumsum(0).tolist()
        return cls(slots=present, owns=owns_dev, rows=tuple(flat[ends[i]:ends[i + 1]] for i in range(len(present))),
                   row_slots=flat[:n])

    def padded_to(self, num_rows: int) -> "LoRABatch":
        """This batch for a forward of `num_rows` >= its rows: the rows past them (a padded decode's, after the
        real ones) run no adapter. The manager pads once per forward, before the model runs."""
        if self.groups is not None:
            return LoRABatch(groups=self.groups.padded_to(num_rows))
        if self.owns is None or self.owns.shape[1] >= num_rows:
            return self
        pad = num_rows - self.owns.shape[1]
        return LoRABatch(slots=self.slots, rows=self.rows, owns=torch.nn.functional.pad(self.owns, (0, 0, 0, pad)),
                         row_slots=torch.nn.functional.pad(self.row_slots, (0, pad), value=NO_ADAPTER))

    def select(self, tokens: torch.Tensor) -> "LoRABatch":
        """The batch of rows `tokens` [n] of this forward (an expert's routed tokens): made once per expert,
        read by both of its projections."""
        if self.groups is not None:
            return LoRABatch(groups=self.groups.select(tokens))
        return self if self.owns is None else LoRABatch(slots=self.slots, owns=self.owns[:, tokens])

    def slot_of_rows(self) -> Optional[torch.Tensor]:
        """[num_rows] int64 on the device, each row's slot (NO_ADAPTER: none); None for a `single` batch."""
        if self.groups is not None:
            return self.groups.row_slots.to(torch.int64)
        return self.row_slots


class LoRAContext:
    """The adapter slots of the rows of the forward that runs now (None: no row has an adapter)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


def low_rank_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    batch: LoRABatch) -> torch.Tensor:
    """y [n, out] + each row's slot's (x @ A.T) @ B.T in torch ops, with a [slots, k, in] and b [out, slots, k]
    (a slot's k = its blocks * rank); `batch` covers x's n rows (`single`, or `slots` with `rows` or `owns`).

    A mixed batch, per slot present: its rows gathered, updated as a batch of that adapter alone would be
    (the same addmm), and copied back (`rows`); or, for an expert's tokens, the update of every row (rows
    are independent through both matmuls) kept on the slot's rows by torch.where (`owns`). Either way no
    slot's values meet another slot's row (a 0/1 mask multiplied in would: 0 x NaN is NaN)."""
    if batch.single is not None:
        return torch.addmm(y, x @ a[batch.single].T, b[:, batch.single].T)
    out = y
    for i, slot in enumerate(batch.slots):
        if batch.rows is None:
            out = torch.where(batch.owns[i], torch.addmm(out, x @ a[slot].T, b[:, slot].T), out)  # [n, out]
            continue
        rows = batch.rows[i]  # [m]
        own = torch.addmm(y.index_select(0, rows), x.index_select(0, rows) @ a[slot].T, b[:, slot].T)  # [m, out]
        out = y.index_copy(0, rows, own) if out is y else out.index_copy_(0, rows, own)
    return out


def add_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """`low_rank_update`, or with grouped rows (`batch.groups`) the Triton kernels' (y written in place)."""
    if batch.groups is not None:
        from vlmrun.lora.triton_ops import add_to_rows

        return add_to_rows(x, y, a, b, batch.groups)
    return low_rank_update(x, y, a, b, batch)


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
        return add_update(x2, y2, self.a, self.b, batch).view(y.shape)


PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertRowsLoRA:
    """The adapters of one forward's routed rows (sorted by expert, `RoutedRows`), for `ExpertsLoRA.add_grouped`.

    With one slot for every row the update keeps the experts' grouping (`segments` is the `RoutedRows`);
    otherwise the rows are regrouped on the device by (slot, expert), group `slot * E_local + expert`
    (`Segments`), rows with no adapter (or another rank's expert) last, in no group."""

    single: Optional[int]  # every row's slot; None: a mixed batch, regrouped
    segments: Any  # `RoutedRows` (single) or `Segments` of the regrouped rows
    order: Optional[torch.Tensor] = None  # [N] the expert-sorted rows in (slot, expert) order
    back: Optional[torch.Tensor] = None  # [N] where each expert-sorted row went in that order
    live: Optional[torch.Tensor] = None  # [N, 1] bool, regrouped rows with an adapter


class ExpertsLoRA:
    """A fused experts block's adapters: per projection a [slots, E_local, rank, in], b [slots, E_local, out, rank].

    `add_grouped` adds every routed row's update at once, grouped on the device like the experts' own rows
    (`vlmrun.layers.grouped_matmul`: no host read); `select` / `add` adapt one expert's rows at a time, for
    the per-expert loop (quantized experts, batches too large for the sync-free ways)."""

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
            self.a[projection] = torch.zeros(s, e, r, n_in, device=self.device, dtype=self.dtype)
            self.b[projection] = torch.zeros(s, e, out, r, device=self.device, dtype=self.dtype)
        if a is None:
            self.a[projection][slot].zero_()
            self.b[projection][slot].zero_()
        else:
            self.a[projection][slot].copy_(a)
            self.b[projection][slot].copy_(b)
        self.filled[projection][slot] = a is not None

    # ------------------------------------------------------------------ every expert at once

    def rows(self, routed: Any) -> Optional[ExpertRowsLoRA]:
        """The adapters of the forward's routed rows (`routed`: `RoutedRows`), made once for both projections;
        None when no row has an adapter or no adapter adapts these experts."""
        batch = self.context.batch
        if batch is None or not self.a:
            return None
        if batch.single is not None:
            return ExpertRowsLoRA(single=batch.single, segments=routed)
        e, s = self.num_local_experts, self.num_slots
        slot = batch.slot_of_rows().index_select(0, routed.tokens)  # [N] each sorted row's slot
        adapted = (slot >= 0) & (routed.experts < e)
        order, segments = Segments.sort(torch.where(adapted, slot * e + routed.experts, s * e), s * e)
        back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
        return ExpertRowsLoRA(single=None, segments=segments, order=order, back=back,
                              live=(segments.experts < s * e)[:, None])

    def add_grouped(self, projection: str, x: torch.Tensor, y: torch.Tensor,
                    rows: ExpertRowsLoRA) -> Optional[torch.Tensor]:
        """y [N, out] + each routed row's update of its slot and expert (x [N, in]; rows sorted by expert):
        two grouped matmuls (`grouped_linear`), no host read; None where neither sync-free way fits."""
        if projection not in self.a:
            return y
        a, b = self.a[projection], self.b[projection]  # [S, E, R, in], [S, E, out, R]
        if rows.single is not None:
            if not self.filled[projection][rows.single]:
                return y
            xa = grouped_linear(x, a[rows.single], rows.segments)  # [N, R]
            delta = None if xa is None else grouped_linear(xa, b[rows.single], rows.segments)  # [N, out]
            return None if delta is None else y + delta
        xa = grouped_linear(x.index_select(0, rows.order), a.flatten(0, 1), rows.segments)  # [N, R], regrouped
        delta = None if xa is None else grouped_linear(xa, b.flatten(0, 1), rows.segments)  # [N, out]
        if delta is None:
            return None
        delta = torch.where(rows.live, delta, 0.0)  # rows in no group: garbage from the GEMM, never added
        return y + delta.index_select(0, rows.back)  # back in expert order

    # ------------------------------------------------------------------ one expert at a time

    def select(self, tokens: torch.Tensor) -> Optional[LoRABatch]:
        """The adapters of an expert's routed tokens (`tokens` [n]: their rows of the forward), made once per
        expert for both projections; None when no row has an adapter or no adapter adapts these experts."""
        batch = self.context.batch
        return None if batch is None or not self.a else batch.select(tokens)

    def add(self, projection: str, local: int, x: torch.Tensor, y: torch.Tensor,
            batch: LoRABatch) -> torch.Tensor:
        """y [n, out] + each routed token's adapter update for expert `local` (x [n, in]; `batch`: the n
        tokens' adapters, `select`)."""
        if projection not in self.a or (batch.single is not None and not self.filled[projection][batch.single]):
            return y
        a = self.a[projection][:, local]  # [S, R, in]
        b = self.b[projection][:, local].permute(1, 0, 2)  # [out, S, R]
        return add_update(x, y, a, b, batch)


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
