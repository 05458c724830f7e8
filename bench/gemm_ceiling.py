"""The GEMM ceiling of a CPU bench workload: the most requests/s this machine allows any engine.

Every engine runs the same dense model on the same requests, so every one multiplies the same
matrices: vision tower, mergers, text layers (prompt and output tokens), LM head. `count_workload`
counts those FLOPs for one batch of `bench.common.make_requests` (prompt lengths as the checkpoint's
processor makes them, no padding counted); `gemm_floor` times every GEMM shape the count contains
on this machine at its best (`F.linear` and oneDNN-packed weights, the faster one, best of several
rounds) and adds them up, attention, norms, rotary, sampling and host work all free; `ceiling`
turns that floor into requests/s. Used by `bench.roofline_cpu` and `bench.bench_cpu_vs_hf --ceiling`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bench.common import make_requests
from vlmrun.layers.packed_linear import onednn_linear, pack_weight


@dataclass
class WorkloadCount:
    """The FLOPs of one batch: its GEMMs (rows of each call, per weight shape), attention FLOPs apart."""

    requests: int
    # (part, out features, in features) -> the rows (M) of each call
    gemm_calls: dict[tuple[str, int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    attention_flops: float = 0.0

    def add_linears(self, part: str, shapes: list[tuple[int, int]], rows: int) -> None:
        """One call of each linear over `rows` rows (a layer's repeated shapes are calls of their own)."""
        for out_features, in_features in shapes:
            self.gemm_calls[(part, out_features, in_features)].append(rows)

    def linear_flops(self) -> dict[str, float]:
        by_part: dict[str, float] = defaultdict(float)
        for (part, out_features, in_features), calls in self.gemm_calls.items():
            by_part[part] += 2.0 * sum(calls) * out_features * in_features
        return by_part


def linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every linear of a module; a Conv3d patch embed counts as the GEMM it is."""
    shapes = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            shapes.append(tuple(sub.weight.shape))
        elif isinstance(sub, torch.nn.Conv3d):
            shapes.append((sub.weight.shape[0], sub.weight[0].numel()))
    return shapes


def count_workload(model, processor, workload: str, requests: int, max_tokens: int, seed: int) -> WorkloadCount:
    """The batch's FLOPs as the best schedule runs them: every image's patches in one vision pass,
    every prompt in one prefill pass (no padding, which HF adds), then one decode step per output
    token after the first over the requests still running, the LM head once per output token."""
    images, prompts, lengths = make_requests(requests, workload, seed, max_tokens)
    count = WorkloadCount(requests)
    text, vision = model.config.text_config, model.config.vision_config
    visual = model.model.visual
    layers = model.model.language_model.layers
    text_shapes = [shape for layer in layers for shape in linear_shapes(layer)]
    head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    attn_width = text.num_attention_heads * head_dim  # QK and PV each cost 2 * width FLOPs per (query, key)
    patches = merged = prompt_tokens = 0
    for image, prompt, n_out in zip(images, prompts, lengths):
        content = [{"type": "text", "text": prompt}]
        if image is not None:
            content.insert(0, {"type": "image", "image": image})
        chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=[chat], images=[image] if image is not None else None, return_tensors="pt")
        prompt_len = int(inputs["input_ids"].shape[1])
        prompt_tokens += prompt_len
        if image is not None:
            image_patches = int(inputs["image_grid_thw"].prod())
            patches += image_patches
            merged += image_patches // vision.spatial_merge_size ** 2
            count.attention_flops += 4.0 * vision.depth * vision.hidden_size * image_patches ** 2
        prefill_pairs = prompt_len * (prompt_len + 1) / 2  # causal (query, key) pairs
        decode_pairs = sum(prompt_len + t for t in range(1, n_out))
        count.attention_flops += 4.0 * attn_width * len(layers) * (prefill_pairs + decode_pairs)
    if patches:
        count.add_linears("vision patch embed", linear_shapes(visual.patch_embed), patches)
        count.add_linears("vision blocks", [s for b in visual.blocks for s in linear_shapes(b)], patches)
        mergers = [visual.merger, *getattr(visual, "deepstack_merger_list", [])]
        count.add_linears("vision mergers", [s for m in mergers for s in linear_shapes(m)], merged)
    count.add_linears("text prefill", text_shapes, prompt_tokens)
    count.add_linears("LM head", linear_shapes(model.lm_head), requests)  # each prompt's last row
    for step in range(1, max(lengths)):
        running = sum(1 for n_out in lengths if n_out > step)
        count.add_linears("text decode", text_shapes, running)
        count.add_linears("LM head", linear_shapes(model.lm_head), running)
    return count


def best_gemm_seconds(rows: int, out_features: int, in_features: int, dtype: torch.dtype, rounds: int) -> float:
    """Seconds of the faster of `F.linear` and the oneDNN-packed weight for [rows, in] x [in, out],
    the best of `rounds` timings (each of enough calls to last ~20 ms)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    best = float("inf")
    for fn in (lambda: F.linear(x, weight), lambda: onednn_linear(x, packed)):
        fn()
        start = time.perf_counter()
        fn()
        calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
    return best


def gemm_floor(count: WorkloadCount, dtype: torch.dtype, rounds: int, cache: dict) -> tuple[float, float]:
    """(seconds, best GFLOP/s seen) of the batch's linears, each call at its shape's best measured rate
    (one timing per distinct (rows, out, in), cached across workloads)."""
    seconds, best_rate = 0.0, 0.0
    for (_, out_features, in_features), calls in count.gemm_calls.items():
        for rows in calls:
            key = (rows, out_features, in_features, dtype)
            if key not in cache:
                cache[key] = best_gemm_seconds(rows, out_features, in_features, dtype, rounds)
            seconds += cache[key]
            best_rate = max(best_rate, 2.0 * rows * out_features * in_features / cache[key] / 1e9)
    return seconds, best_rate


@dataclass
class Ceiling:
    gflop_by_part: dict[str, float]  # linears by part, and "attention"
    floor_s: float  # the batch's linears at their shapes' best rates
    best_rate: float  # GFLOP/s, the fastest shape
    req_per_s: float

    def describe(self) -> str:
        parts = ", ".join(f"{part} {gflop:.1f}" for part, gflop in self.gflop_by_part.items())
        return (f"{sum(self.gflop_by_part.values()):.1f} GFLOP per batch ({parts}); linears at their shapes' "
                f"best rates (up to {self.best_rate:.0f} GFLOP/s): {self.floor_s * 1e3:.0f} ms -> ceiling "
                f"{self.req_per_s:.2f} req/s")


def ceiling(model, processor, workload: str, dtype: torch.dtype, requests: int, max_tokens: int, seed: int,
            rounds: int = 5, cache: dict | None = None) -> Ceiling:
    """The GEMM ceiling of one batch of `make_requests` (the requests of `seed`) on this machine."""
    count = count_workload(model, processor, workload, requests, max_tokens, seed)
    floor_s, best_rate = gemm_floor(count, dtype, rounds, {} if cache is None else cache)
    gflop = {part: flops / 1e9 for part, flops in count.linear_flops().items()}
    gflop["attention"] = count.attention_flops / 1e9
    return Ceiling(gflop, floor_s, best_rate, requests / floor_s)
