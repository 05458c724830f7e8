"""LoRA on MoE experts without a host read (`ExpertsLoRA.add_grouped`): every routed row's low-rank update
as grouped matmuls, against the per-expert loop (`FusedExperts._forward_per_expert`, one expert's rows
at a time) and the math, for one adapter, a mixed batch (base rows, several slots, padding rows) and
expert parallelism; and nothing read on the host."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from tests.launch_sync_guard import LaunchSyncGuard
from vlmrun.layers.grouped_matmul import RoutedRows
from vlmrun.layers.moe import FusedExperts
from vlmrun.lora.layers import NO_ADAPTER, ExpertsLoRA, LoRABatch, LoRAContext
from vlmrun.parallel import TensorParallel

HIDDEN, INTER, EXPERTS, TOP_K, SLOTS, RANK = 32, 16, 4, 2, 3, 4


def adapted_experts(dtype: torch.dtype, seed: int = 0, tp: Optional[TensorParallel] = None,
                    whole: Optional[FusedExperts] = None) -> FusedExperts:
    """Random experts with random adapters in slots 0 and 2 (slot 1 adapts only gate_up_proj); `whole`:
    the experts and adapters to cut this rank's share from."""
    g = torch.Generator().manual_seed(seed)
    experts = FusedExperts(EXPERTS, HIDDEN, INTER, **({} if tp is None else {"tp": tp})).to(dtype)
    mine = experts.experts
    context = LoRAContext()
    shapes = {"gate_up_proj": (2 * INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    experts.lora = ExpertsLoRA(context, SLOTS, RANK, mine.length, shapes, torch.device("cpu"), dtype)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.copy_(torch.randn(EXPERTS, *p.shape[1:], generator=g)[mine.start:mine.start + mine.length] * 0.3)
        if whole is not None:
            experts.gate_up_proj.copy_(whole.gate_up_proj[mine.start:mine.start + mine.length])
            experts.down_proj.copy_(whole.down_proj[mine.start:mine.start + mine.length])
    for slot in range(SLOTS):
        for projection, (out, n_in) in shapes.items():
            if slot == 1 and projection == "down_proj":
                experts.lora.write(slot, projection, None, None)
                continue
            a = torch.randn(EXPERTS, RANK, n_in, generator=g).to(dtype) * 0.3
            b = torch.randn(EXPERTS, out, RANK, generator=g).to(dtype) * 0.3
            if whole is not None:
                a = whole.lora.a[projection][slot]
                b = whole.lora.b[projection][slot]
            experts.lora.write(slot, projection, a[mine.start:mine.start + mine.length],
                               b[mine.start:mine.start + mine.length])
    return experts


def bind(experts: FusedExperts, slots: list[int], lengths: list[int], num_rows: int) -> None:
    experts.lora.context.batch = LoRABatch.of_spans(slots, lengths, SLOTS, torch.device("cpu"),
                                                    experts.gate_up_proj.dtype).padded_to(num_rows)


def routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])  # [T, k]
    weights = torch.rand(tokens, TOP_K, generator=g)
    return x, ids, weights


def reference(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              row_slots: list[int]) -> torch.Tensor:
    """Token by token in float64: each expert's SwiGLU with its row's adapter added to both projections."""
    lora = experts.lora
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double()):
            xt, s = x[t].double(), row_slots[t]
            h = F.linear(xt, experts.gate_up_proj[e].double())
            if s != NO_ADAPTER:
                h += lora.b["gate_up_proj"][s, e].double() @ (lora.a["gate_up_proj"][s, e].double() @ xt)
            gate, up = h.chunk(2)
            inner = F.silu(gate) * up
            y = F.linear(inner, experts.down_proj[e].double())
            if s != NO_ADAPTER:
                y += lora.b["down_proj"][s, e].double() @ (lora.a["down_proj"][s, e].double() @ inner)
            out[t] += w * y
    return out


CASES = {  # name -> (span slots, span lengths, rows of the forward)
    "one adapter": ([2], [7], 7),
    "the adapter that leaves down_proj alone": ([1], [7], 7),
    "mixed with base rows": ([0, NO_ADAPTER, 2, 1, 0], [2, 1, 3, 2, 1], 9),
    "mixed, padded decode": ([2, NO_ADAPTER, 0], [2, 1, 2], 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_update_equals_the_per_expert_loop(case, dtype):
    slots, lengths, num_rows = CASES[case]
    experts = adapted_experts(dtype)
    x, ids, weights = routing(num_rows)
    x, weights = x.to(dtype), weights.to(dtype)
    bind(experts, slots, lengths, num_rows)
    with torch.no_grad():
        routed = RoutedRows.sort(ids, weights, 0, EXPERTS, EXPERTS)
        assert experts.lora.rows(routed) is not None
        grouped = experts._forward_grouped(x, routed)
        loop = experts._forward_per_expert(x, routed)
    row_slots = [s for s, n in zip(slots, lengths) for _ in range(n)]
    want = reference(experts, x, ids, weights, row_slots + [NO_ADAPTER] * (num_rows - len(row_slots)))
    if dtype == torch.float32:
        torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)  # one adapter: equal; mixed: a slot's GEMM over fewer rows
        torch.testing.assert_close(grouped.double(), want, atol=1e-5, rtol=1e-5)
    else:  # the loop's addmm rounds y + delta once, the grouped update twice: both as near the math
        loop_error = (loop.double() - want).abs().max()
        assert (grouped.double() - want).abs().max() <= 2 * loop_error + 0.02
        torch.testing.assert_close(grouped.double(), want, atol=0.1, rtol=0.05)


def test_rows_of_no_adapter_are_the_base_experts():
    """A mixed batch's base-model and padding rows get exactly the experts without adapters."""
    experts = adapted_experts(torch.float32)
    x, ids, weights = routing(8)
    with torch.no_grad():
        routed = RoutedRows.sort(ids, weights, 0, EXPERTS, EXPERTS)
        base = experts._forward_grouped(x, routed)  # no batch bound: no adapter
        bind(experts, [2, NO_ADAPTER, 0], [2, 3, 2], 8)
        mixed = experts._forward_grouped(x, routed)
    assert torch.equal(mixed[2:5], base[2:5]) and torch.equal(mixed[7:], base[7:])
    assert not torch.allclose(mixed[:2], base[:2])


def test_no_host_read_with_adapters():
    """The whole experts forward with a mixed batch bound, under the launch guard: it raises on a host read
    (the per-expert loop's `.tolist()` of the counts did)."""
    experts = adapted_experts(torch.float32)
    x, ids, weights = routing(9)
    bind(experts, [0, NO_ADAPTER, 2, 1], [3, 1, 3, 2], 9)
    with torch.no_grad():
        expected = experts(x, ids, weights)
        with LaunchSyncGuard(host_inputs=[]):
            out = experts(x, ids, weights)
    assert torch.equal(out, expected)


def test_expert_parallel_ranks_sum_to_all_experts():
    """Two ranks holding experts [0, 2) and [2, 4), adapters cut the same way: their outputs add up to the
    whole block's (rows of the other rank's experts add nothing, adapter or not)."""
    whole = adapted_experts(torch.float32)
    x, ids, weights = routing(9)
    bind(whole, [0, NO_ADAPTER, 2, 1], [3, 1, 3, 2], 9)
    total = torch.zeros(9, HIDDEN)
    with torch.no_grad():
        expected = whole(x, ids, weights)
        for rank in range(2):
            part = adapted_experts(torch.float32, tp=TensorParallel(rank=rank, size=2, expert_parallel=True),
                                   whole=whole)
            part.lora.context.batch = whole.lora.context.batch
            total += part(x, ids, weights)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
