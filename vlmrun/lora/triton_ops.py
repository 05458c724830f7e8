"""The batched LoRA update of rows of mixed adapters as two Triton kernels (opt-in: `lora_kernel="triton"`).

Imported only when an engine asks for it (triton is in the CUDA extra). Per row with an adapter in
slot s: y[row] += (x[row] @ a[s].T) @ b[:, s].T, with `vlmrun.lora.layers`' layout (a [slots, k, in],
b [out, slots, k], k = blocks * rank: the fused q | k | v and gate | up parts are blocks of k, the
scaling folded into b). Rows are grouped by slot (`SlotGroups`): a program takes a tile of one slot's
rows, gathers them from x, and

- shrink: xa[rows] = x[rows] @ a[s].T, accumulated in float32 over the input features, kept in float32;
- expand: y[rows, cols] += xa[rows] (in the weights' dtype) @ b[cols, s].T, added in place into y.

Rows with no adapter belong to no group and are never read or written, so padding rows and base-model
rows cost nothing, and the work grows with the rows that have an adapter, not with the number of
slots (unlike the masked torch update). Every k column of a slot is multiplied: a fused layer's
off-block zeros of b are multiplied too, as in the torch update. The MoE experts' update runs as grouped
matmuls (`ExpertsLoRA.add_grouped`, each row's slot from `SlotGroups.row_slots`); only their per-expert
loop (quantized experts) uses these kernels, grouping an expert's routed tokens by their rows' slots on
the device (`SlotGroups.select`).

Checked against the torch update on the CPU through Triton's interpreter (tests/lora_triton_check.py);
not yet run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
import triton
import triton.language as tl

from vlmrun.host_to_device import upload

BLOCK_M = 16  # rows of one tile (tl.dot's smallest size)
BLOCK_IN = 64  # input features per step of the shrink
BLOCK_OUT = 64  # output features per expand program


@dataclass(frozen=True)
class SlotGroups:
    """A forward's rows grouped by adapter slot: slot s's rows are rows[starts[s] : starts[s] + counts[s]]."""

    rows: torch.Tensor  # [num_rows] int32, row indices grouped by slot (the rows of no slot first)
    starts: torch.Tensor  # [slots] int32
    counts: torch.Tensor  # [slots] int32
    max_count: int  # an upper bound of counts (sizes the grid without a device-to-host copy)
    row_slots: torch.Tensor  # [num_rows] int32, each row's slot (-1: none); an expert groups its tokens by it

    @classmethod
    def of_spans(cls, slots: Sequence[int], lengths: Sequence[int], num_slots: int,
                 device: torch.device) -> "SlotGroups":
        """Spans of `lengths[i]` consecutive rows running slot `slots[i]` (-1: none), grouped on the host
        and uploaded as one tensor (`vlmrun.host_to_device.upload`)."""
        row_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32),
                                            torch.tensor(lengths, dtype=torch.int64))  # [num_rows]
        rows, starts, counts = _group(row_slots, num_slots)
        flat = upload(torch.cat([rows, starts, counts, row_slots]), device)
        n, s = rows.shape[0], num_slots
        return cls(rows=flat[:n], starts=flat[n:n + s], counts=flat[n + s:n + 2 * s], max_count=int(counts.max()),
                   row_slots=flat[n + 2 * s:])

    @classmethod
    def of_row_slots(cls, row_slots: torch.Tensor, num_slots: int) -> "SlotGroups":
        """Rows grouped by `row_slots` [n] (-1: none) on their device: no host sync (the grid covers n rows a slot)."""
        rows, starts, counts = _group(row_slots, num_slots)
        return cls(rows=rows, starts=starts, counts=counts, max_count=row_slots.shape[0], row_slots=row_slots)

    def padded_to(self, num_rows: int) -> "SlotGroups":
        """These groups for a forward of `num_rows` >= its rows: the rows past them (a padded decode's) in no group."""
        pad = num_rows - self.row_slots.shape[0]
        if pad <= 0:
            return self
        return replace(self, row_slots=torch.nn.functional.pad(self.row_slots, (0, pad), value=-1))

    def select(self, tokens: torch.Tensor) -> "SlotGroups":
        """The groups of rows `tokens` [n] of this forward (an expert's routed tokens), grouped on the device."""
        return SlotGroups.of_row_slots(self.row_slots[tokens], self.starts.shape[0])


def _group(row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [rows with an adapter] grouped by slot (ascending within one), starts [slots], counts [slots];
    int32, on `row_slots`' device."""
    order = row_slots.argsort(stable=True)  # the -1 rows first, then slot by slot
    counts = torch.bincount(row_slots + 1, minlength=num_slots + 1)  # [slots + 1], the -1 rows at 0
    ends = counts.cumsum(0)
    return (order.to(torch.int32), (ends - counts)[1:].to(torch.int32), counts[1:].to(torch.int32))


@triton.jit
def _tile_rows(rows_ptr, starts_ptr, slot, tile, count, n_rows, BLOCK_M: tl.constexpr):
    """Tile `tile` of slot `slot`'s rows: their indices [BLOCK_M] (int64) and which are real rows."""
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = offs_m < count
    rows = tl.load(rows_ptr + tl.load(starts_ptr + slot) + offs_m, mask=live, other=0).to(tl.int64)
    return rows, live & (rows < n_rows)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, xa_ptr, rows_ptr, starts_ptr, counts_ptr, n_rows, n_in, k,
                   stride_xm, stride_xi, stride_as, stride_ak, stride_ai, stride_xam,
                   BLOCK_M: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    tile = tl.program_id(1)
    count = tl.load(counts_ptr + slot)
    if tile * BLOCK_M >= count:
        return
    rows, live = _tile_rows(rows_ptr, starts_ptr, slot, tile, count, n_rows, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for i0 in range(0, n_in, BLOCK_IN):
        offs_i = i0 + tl.arange(0, BLOCK_IN)
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                     mask=live[:, None] & (offs_i[None, :] < n_in), other=0.0)  # [BLOCK_M, BLOCK_IN]
        at = tl.load(a_ptr + slot * stride_as + offs_k[None, :] * stride_ak + offs_i[:, None] * stride_ai,
                     mask=(offs_k[None, :] < k) & (offs_i[:, None] < n_in), other=0.0)  # [BLOCK_IN, BLOCK_K]
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    tl.store(xa_ptr + rows[:, None] * stride_xam + offs_k[None, :], acc, mask=live[:, None] & (offs_k[None, :] < k))


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, counts_ptr, n_rows, n_out, k,
                   stride_xam, stride_bo, stride_bs, stride_bk, stride_ym, stride_yo,
                   BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    tile = tl.program_id(1)
    col0 = tl.program_id(2) * BLOCK_OUT
    count = tl.load(counts_ptr + slot)
    if tile * BLOCK_M >= count:
        return
    rows, live = _tile_rows(rows_ptr, starts_ptr, slot, tile, count, n_rows, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_o = col0 + tl.arange(0, BLOCK_OUT)
    xa = tl.load(xa_ptr + rows[:, None] * stride_xam + offs_k[None, :],
                 mask=live[:, None] & (offs_k[None, :] < k), other=0.0)  # [BLOCK_M, BLOCK_K] float32
    bt = tl.load(b_ptr + offs_o[None, :] * stride_bo + slot * stride_bs + offs_k[:, None] * stride_bk,
                 mask=(offs_o[None, :] < n_out) & (offs_k[:, None] < k), other=0.0)  # [BLOCK_K, BLOCK_OUT]
    delta = tl.dot(xa.to(bt.dtype), bt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_OUT] float32
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_o[None, :] * stride_yo
    y_mask = live[:, None] & (offs_o[None, :] < n_out)
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask)


def add_to_rows(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                groups: SlotGroups) -> torch.Tensor:
    """y [n, out] + each grouped row's slot's (x @ a[s].T) @ b[:, s].T, written into y (also returned);
    x [n, in], a [slots, k, in], b [out, slots, k]. Rows in no group are left as they are."""
    n, n_in = x.shape
    slots, k, _ = a.shape
    if groups.max_count == 0 or n == 0:
        return y
    block_k = max(16, triton.next_power_of_2(k))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # float32 as torch's matmul; bf16 / fp16 ignore it
    xa = torch.empty(n, k, device=x.device, dtype=torch.float32)  # [n, k]: the grouped rows' shrink
    tiles = triton.cdiv(groups.max_count, BLOCK_M)
    _shrink_kernel[(slots, tiles)](x, a, xa, groups.rows, groups.starts, groups.counts, n, n_in, k,
                                   x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), xa.stride(0),
                                   BLOCK_M=BLOCK_M, BLOCK_IN=BLOCK_IN, BLOCK_K=block_k, PRECISION=precision)
    n_out = y.shape[1]
    _expand_kernel[(slots, tiles, triton.cdiv(n_out, BLOCK_OUT))](
        xa, b, y, groups.rows, groups.starts, groups.counts, n, n_out, k,
        xa.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_OUT=BLOCK_OUT, BLOCK_K=block_k, PRECISION=precision)
    return y
