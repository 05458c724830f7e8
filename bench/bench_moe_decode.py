"""One MoE experts block at decode and prefill sizes: routed on the device vs the per-expert loop.

`FusedExperts.forward` (vlmrun/layers/moe.py) sorts a step's (token, expert) assignments on the device
and runs every expert through one grouped matmul per projection (`vlmrun.layers.grouped_matmul`: torch's
grouped GEMM on the CPU); `_forward_per_expert` is the loop it replaces (each expert's row count read on
the host, one matmul pair per expert with tokens), which stays for quantized experts. (MoE decode with and
without CUDA graphs in a whole engine, on a GPU: bench/bench_moe_graphs.py.)
Both sum bit for bit the same; this times them, and the gathered-bmm fallback (CUDA without torch's
fast grouped GEMM) at decode sizes. Milliseconds per call (mean after warm-ups), random weights, the
shapes of a Qwen3-30B-A3B layer scaled by `--scale` (1: hidden 2048, expert width 768, 128 experts of
which 8 per token; the default 0.25 keeps the weights small: hidden 512, width 192, 32 experts).

    python -m bench.bench_moe_decode [--scale 0.25] [--dtype float32] [--threads N] [--tokens 1 8 64 512 2048]
        [--lora-slots N]   # LoRA on the experts: N adapters (and base rows) in the batch
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from vlmrun.layers.grouped_matmul import GATHER_BUDGET, RoutedRows, gathered_linear
from vlmrun.layers.moe import FusedExperts

FULL = dict(hidden=2048, width=768, experts=128, top_k=8)  # Qwen3-30B-A3B / Qwen3-VL-30B-A3B


def per_call_ms(fn: Callable[[], object], min_calls: int = 5, min_seconds: float = 0.5) -> float:
    for _ in range(2):
        fn()
    calls, start = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def gathered(experts: FusedExperts, x: torch.Tensor, routed: RoutedRows) -> torch.Tensor:
    """The whole block through the gathered fallback (both projections)."""
    h = gathered_linear(x[routed.tokens], experts.gate_up_proj, routed)
    gate, up = h.chunk(2, dim=-1)
    y = gathered_linear(experts.act_fn(gate) * up, experts.down_proj, routed)
    return routed.combine(y)


def bind_adapters(experts: FusedExperts, slots: int, tokens: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    """LoRA on the experts (rank 8): `slots` random adapters, the tokens split between them and the base model
    (one slot: every token runs it); the grouped path then adds `ExpertsLoRA.add_grouped`, the loop `add`."""
    from vlmrun.lora.layers import NO_ADAPTER, ExpertsLoRA, LoRABatch, LoRAContext

    shapes = {"gate_up_proj": (2 * experts.intermediate, experts.hidden),
              "down_proj": (experts.hidden, experts.intermediate)}
    experts.lora = ExpertsLoRA(LoRAContext(), slots, 8, experts.experts.length, shapes, torch.device("cpu"), dtype)
    for slot in range(slots):
        for projection, (out, n_in) in shapes.items():
            experts.lora.write(slot, projection, (torch.randn(experts.experts.length, 8, n_in, generator=gen) * 0.1).to(dtype),
                               (torch.randn(experts.experts.length, out, 8, generator=gen) * 0.1).to(dtype))
    spans = [0] if slots == 1 else [*range(slots), NO_ADAPTER]
    lengths = [tokens // len(spans)] * len(spans)
    lengths[-1] += tokens - sum(lengths)
    spans, lengths = zip(*[(s, n) for s, n in zip(spans, lengths) if n]) if tokens >= len(spans) else ([0], [tokens])
    experts.lora.context.batch = LoRABatch.of_spans(list(spans), list(lengths), slots, torch.device("cpu"), dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    parser.add_argument("--lora-slots", type=int, default=0,
                        help="LoRA on the experts: this many adapters in the batch (1: all tokens; more: and base rows)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hidden, width = int(FULL["hidden"] * args.scale), int(FULL["width"] * args.scale)
    num_experts, k = max(int(FULL["experts"] * args.scale), FULL["top_k"]), FULL["top_k"]
    gen = torch.Generator().manual_seed(0)
    experts = FusedExperts(num_experts, hidden, width)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * hidden ** -0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * width ** -0.5)
    experts.to(dtype)
    print(f"hidden {hidden}, expert width {width}, {num_experts} experts, top-{k}, {args.dtype}, "
          f"{torch.get_num_threads()} threads; ms per call")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        ids = torch.rand(tokens, num_experts, generator=gen).topk(k, dim=1).indices
        weights = torch.rand(tokens, k, generator=gen).to(dtype)
        if args.lora_slots:
            bind_adapters(experts, args.lora_slots, tokens, dtype, gen)
        with torch.no_grad():
            routed = RoutedRows.sort(ids, weights, 0, num_experts, num_experts)
            loop = per_call_ms(lambda: experts._forward_per_expert(x, RoutedRows.sort(ids, weights, 0, num_experts,
                                                                                       num_experts)))
            grouped = per_call_ms(lambda: experts(x, ids, weights))
            if args.lora_slots:  # a mixed batch's slot GEMMs run over fewer rows than the loop's: rounding apart
                torch.testing.assert_close(experts(x, ids, weights), experts._forward_per_expert(x, routed))
            else:
                assert torch.equal(experts(x, ids, weights), experts._forward_per_expert(x, routed))
            fits = not args.lora_slots and tokens * k * 2 * width * hidden <= GATHER_BUDGET
            gather = per_call_ms(lambda: gathered(experts, x, RoutedRows.sort(ids, weights, 0, num_experts,
                                                                              num_experts))) if fits else None
        extra = f", gathered bmm {gather:8.3f}" if gather is not None else ""
        print(f"  {tokens:5d} tokens: per-expert loop {loop:8.3f}, grouped (no host sync) {grouped:8.3f} "
              f"({loop / grouped:4.2f}x){extra}", flush=True)


if __name__ == "__main__":
    main()
