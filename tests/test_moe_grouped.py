"""MoE experts routed on the device (`vlmrun.layers.grouped_matmul`): the same sums as the per-expert
loop, nothing read on the host, expert parallelism, the gathered fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.launch_sync_guard import HostSync, LaunchSyncGuard, syncs_of
from vlmrun.layers.grouped_matmul import RoutedRows, gathered_linear, grouped_linear
from vlmrun.layers.moe import FusedExperts, SparseMoeBlock
from vlmrun.parallel import TensorParallel

SIZES = [  # hidden, expert intermediate, experts, top-k, tokens
    (64, 24, 4, 2, 1), (64, 24, 4, 2, 37), (32, 16, 8, 2, 3), (128, 64, 16, 4, 200)]


def random_block(hidden: int, inter: int, experts: int, k: int, dtype: torch.dtype, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, inter, experts, k, shared_intermediate=16).to(dtype)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    return block


def reference(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token by token: the sum over its k experts of weight * down(silu(gate(x)) * up(x)), in float64."""
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double()):
            gate, up = F.linear(x[t].double(), gate_up[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
def test_grouped_equals_the_per_expert_loop(size, dtype):
    """Bit for bit the loop's sums (the grouped GEMM runs one mm per expert on the CPU), and the math."""
    hidden, inter, num_experts, k, tokens = size
    block = random_block(hidden, inter, num_experts, k, dtype)
    x = torch.randn(tokens, hidden, dtype=dtype)
    with torch.no_grad():
        weights, ids = block.route(x)
        routed = RoutedRows.sort(ids, weights, 0, num_experts, num_experts)
        grouped = block.experts(x, ids, weights)
        loop = block.experts._forward_per_expert(x, routed)
    assert torch.equal(grouped, loop)
    tol = 1e-5 if dtype == torch.float32 else 0.25  # bfloat16: intermediate roundings of outputs ~10
    torch.testing.assert_close(grouped.double(), reference(block.experts, x, ids, weights), atol=tol, rtol=tol)


def test_an_expert_without_tokens_and_one_with_all():
    """Every token routed to experts 1 and 3 of 4: experts 0 and 2 get no rows (empty groups)."""
    block = random_block(64, 24, 4, 2, torch.float32)
    x = torch.randn(5, 64)
    ids = torch.tensor([[3, 1]] * 5)
    weights = torch.rand(5, 2)
    with torch.no_grad():
        out = block.experts(x, ids, weights)
    torch.testing.assert_close(out.double(), reference(block.experts, x, ids, weights), atol=1e-5, rtol=1e-5)


def test_routing_reads_nothing_on_the_host():
    """The whole block (router, sort, grouped matmuls, shared expert) under the launch guard: its weights
    are device state, so a read of the expert counts (the loop's `.tolist()`) raises."""
    block = random_block(64, 24, 4, 2, torch.float32)
    x = torch.randn(7, 64)
    with torch.no_grad():
        expected = block(x)
        with LaunchSyncGuard(host_inputs=[]):  # x: made before, so device-resident like the weights
            out = block(x)
    assert torch.equal(out, expected)


def test_the_loop_is_what_the_guard_catches():
    """The guard sees the per-expert loop's host read (it stays for quantized experts and LoRA on experts)."""
    block = random_block(64, 24, 4, 2, torch.float32)
    x = torch.randn(7, 64)
    with torch.no_grad():
        weights, ids = block.route(x)
        routed = RoutedRows.sort(ids, weights, 0, 4, 4)
        syncs = syncs_of(lambda: block.experts._forward_per_expert(x, routed))
    assert syncs and "tolist" in syncs[0]
    with pytest.raises(HostSync), torch.no_grad(), LaunchSyncGuard(host_inputs=[]):
        block.experts._forward_per_expert(x, routed)


def test_expert_parallel_ranks_sum_to_all_experts():
    """Two ranks holding experts [0, 2) and [2, 4): their outputs add up to the whole block's experts."""
    whole = random_block(64, 24, 4, 2, torch.float32).experts
    x = torch.randn(9, 64)
    ids = torch.tensor([[0, 2], [1, 3], [3, 2], [0, 1], [2, 0], [1, 2], [3, 0], [0, 3], [1, 0]])
    weights = torch.rand(9, 2)
    total = torch.zeros(9, 64)
    for rank in range(2):
        part = FusedExperts(4, 64, 24, tp=TensorParallel(rank=rank, size=2, expert_parallel=True))
        with torch.no_grad():
            part.gate_up_proj.copy_(whole.gate_up_proj[2 * rank:2 * rank + 2])
            part.down_proj.copy_(whole.down_proj[2 * rank:2 * rank + 2])
            total += part(x, ids, weights)
    with torch.no_grad():
        expected = whole(x, ids, weights)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-6)


def test_gathered_fallback_equals_per_row_products():
    """The sync-free fallback where torch's grouped GEMM would read the offsets on the host (CUDA other
    than bfloat16 on sm90 / sm100): each row times its expert's weight."""
    torch.manual_seed(0)
    weight = torch.randn(4, 12, 20)  # [E, out, in]
    experts = torch.tensor([0, 0, 1, 3, 3, 3])
    x = torch.randn(6, 20)
    routed = RoutedRows.sort(experts[:, None], torch.ones(6, 1), 0, 4, 4)
    expected = torch.stack([F.linear(x[i], weight[e]) for i, e in enumerate(experts.tolist())])
    torch.testing.assert_close(gathered_linear(x, weight, routed), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped_linear(x, weight, routed), expected, atol=1e-5, rtol=1e-5)


def test_rows_sorted_by_expert_on_the_device():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    routed = RoutedRows.sort(ids, torch.arange(6.0).view(3, 2), 0, 4, 4)
    assert routed.experts.tolist() == [0, 0, 1, 1, 2, 2]
    assert routed.tokens.tolist() == [0, 1, 1, 2, 0, 2]  # token order inside an expert
    assert routed.weights.tolist() == [1.0, 2.0, 3.0, 5.0, 0.0, 4.0]
    assert routed.slots.tolist() == [[0, 4], [1, 2], [3, 5]]  # each token: its experts ascending
    assert routed.ends.tolist() == [2, 4, 6, 6]
    assert routed.local is None
