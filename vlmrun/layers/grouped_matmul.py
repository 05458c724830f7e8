"""Grouped matmuls for MoE experts: rows sorted by expert, no host read of how many each expert got.

`RoutedRows.sort` turns a step's routing (top-k expert ids and weights per token) into its assignments
sorted by local expert, entirely on the device: the stable argsort keeps each expert's tokens in token
order, and `ends[e]` (where expert e's rows end) comes from a `searchsorted` over the sorted ids, so no
count is read on the host (`torch.bincount` would read the largest id back on CUDA). `combine` adds
each token's rows back in expert order (a gather and k adds: deterministic, no scatter).

`grouped_linear(x, weight, routed)` multiplies each sorted row by its expert's [out, in] weight:

- `torch._grouped_mm` (torch's grouped GEMM) wherever it runs without reading the offsets on the host
  (`grouped_mm_syncs_free`): on the CPU for every float dtype (there it runs one `mm` per expert over
  its slice of rows: the same products as a per-expert `F.linear`), and on CUDA for bfloat16 on
  compute capability 9.x / 10.x (its CUTLASS kernel). Elsewhere on CUDA torch's fallback copies the
  offsets to the host; its kernels also want 16-byte aligned rows (`in` a multiple of 16 bytes).
- otherwise, for up to `GATHER_BUDGET` weight elements, each row's expert weight gathered and one
  batched matmul ([N, 1, in] @ [N, in, out]): sync-free, decode-sized batches.
- otherwise `grouped_linear` returns None and the caller runs its per-expert loop (which reads the
  counts on the host: prefill-sized batches on GPUs / dtypes torch's grouped GEMM does not cover).

`runs_sync_free` says ahead of time which of these a given row count takes (whether a decode of that
size can be captured in a CUDA graph). `Segments.sort` is the sort-and-search itself for any grouping
of rows (LoRA on the experts groups its rows by adapter slot and expert with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

GATHER_BUDGET = 1 << 25  # weight elements the gathered fallback may materialize (N * out * in)
FAST_CUDA_MAJORS = (9, 10)  # compute capabilities where torch's grouped GEMM has its CUTLASS kernel


@dataclass(frozen=True)
class Segments:
    """Rows sorted by group: each sorted row's group (the index of its weight in a stacked [G, out, in]) and
    where each group's rows end. Rows of no group (group id G) sort last, past `ends[-1]`."""

    experts: torch.Tensor  # [N] int64, each sorted row's group (G: none)
    ends: torch.Tensor  # [G] int32, group g's rows are [ends[g-1], ends[g])

    @classmethod
    def sort(cls, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, "Segments"]:
        """groups [N] int64 in [0, num_groups] (num_groups: no group) -> (order [N]: the rows grouped, stably,
        on their device; the segments of the sorted rows). No count read on the host."""
        order = groups.argsort(stable=True)  # [N]
        sorted_groups = groups[order]
        bounds = torch.arange(num_groups, device=groups.device, dtype=groups.dtype)
        ends = torch.searchsorted(sorted_groups, bounds, right=True).to(torch.int32)  # [G]
        return order, cls(experts=sorted_groups, ends=ends)


@dataclass(frozen=True)
class RoutedRows:
    """A forward's (token, expert) assignments sorted by this rank's experts (stable: token order inside one).

    Assignments to experts another rank holds (expert parallelism) sort last, past `ends[-1]`: their
    rows are computed by no expert, and `local` masks them out."""

    tokens: torch.Tensor  # [N] int64, the token of each sorted assignment (N = T * k)
    weights: torch.Tensor  # [N] its routing weight (x's dtype)
    experts: torch.Tensor  # [N] int64, its local expert (num_local for another rank's expert)
    ends: torch.Tensor  # [num_local] int32, expert e's rows are [ends[e-1], ends[e])
    local: Optional[torch.Tensor]  # [N] bool, held by this rank (None: every expert is local)
    slots: torch.Tensor  # [T, k] int64, where each token's j-th smallest expert's row sorted to
    token_weights: torch.Tensor  # [T, k] the routing weight of each token's j-th smallest expert

    @classmethod
    def sort(cls, expert_ids: torch.Tensor, weights: torch.Tensor, first_local: int, num_local: int,
             num_experts: int) -> "RoutedRows":
        """expert_ids, weights: [T, k] -> the T * k assignments sorted by local expert (this rank holds experts
        [first_local, first_local + num_local) of `num_experts`), on their device."""
        num_tokens, k = expert_ids.shape
        expert_ids, by_id = expert_ids.sort(dim=1)  # each token's experts ascending, as `combine` adds them
        local_ids = expert_ids.flatten() - first_local  # [N], token-major
        local = None
        if num_local < num_experts:  # expert parallelism: the others' assignments sort last
            held = (local_ids >= 0) & (local_ids < num_local)
            local_ids = torch.where(held, local_ids, num_local)
            local = held
        order, segments = Segments.sort(local_ids, num_local)  # [N] assignments grouped by expert
        experts, ends = segments.experts, segments.ends
        slots = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
        token_weights = weights.gather(1, by_id)  # [T, k]
        return cls(tokens=order // k, weights=token_weights.flatten()[order], experts=experts, ends=ends,
                   local=None if local is None else local[order], slots=slots.view(num_tokens, k),
                   token_weights=token_weights)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """y [N, H] (sorted rows) -> [T, H]: each token's rows times their routing weights, added in expert order
        one after the other from zero (the per-expert loop's sums, bit for bit; no scatter: no atomics on CUDA)."""
        out = y.new_zeros(self.slots.shape[0], y.shape[1])
        for j in range(self.slots.shape[1]):
            out = out + y.index_select(0, self.slots[:, j]) * self.token_weights[:, j, None]
        return out


def grouped_mm_sync_free(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` with offsets runs here without reading them on the host."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.version.hip is None:
        return torch.cuda.get_device_capability(device)[0] in FAST_CUDA_MAJORS
    return False


def runs_sync_free(rows: int, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `grouped_linear` over `rows` rows of `in_features` (weights [E, out_features, in_features] of
    `dtype` on `device`, contiguous as parameters are) takes a sync-free way: torch's grouped GEMM, or the
    gathered fallback within `GATHER_BUDGET`. What decides whether a decode of that many rows can be captured."""
    per_16_bytes = 16 // torch.empty(0, dtype=dtype).element_size()
    return ((grouped_mm_sync_free(device, dtype) and in_features % per_16_bytes == 0)
            or rows * out_features * in_features <= GATHER_BUDGET)


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM takes rows and weights whose inner stride is a whole 16 bytes."""
    per_16_bytes = 16 // x.element_size()
    return (x.is_contiguous() and weight.is_contiguous() and x.shape[1] % per_16_bytes == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, routed: Union[RoutedRows, Segments]) -> Optional[torch.Tensor]:
    """x [N, in] (rows sorted as `routed`) @ their experts' (groups') weight [E_local, out, in] -> [N, out]; None
    when neither sync-free way fits here (the caller loops over experts). Rows of no group (other ranks'
    experts): garbage (grouped GEMM) or the last group's product (gathered); the caller masks them."""
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[1])
    if grouped_mm_sync_free(x.device, x.dtype) and x.dtype == weight.dtype and _aligned(x, weight):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=routed.ends)
    if x.shape[0] * weight.shape[1] * weight.shape[2] <= GATHER_BUDGET:
        return gathered_linear(x, weight, routed)
    return None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, routed: Union[RoutedRows, Segments]) -> torch.Tensor:
    """The fallback: each row's expert weight gathered ([N, out, in]), one batched matmul -> [N, out]."""
    experts = routed.experts.clamp(max=weight.shape[0] - 1)  # another rank's rows: any expert, masked later
    return torch.bmm(x.unsqueeze(1), weight[experts].transpose(1, 2).to(x.dtype)).squeeze(1)
