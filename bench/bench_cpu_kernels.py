"""The CPU fast path's kernels against what they replace, at the bench model's shapes, one process.

The shapes of the CPU bench checkpoint (bench/common.py; text hidden 512, 8 query / 4 KV heads of 64,
page 16; vision hidden 256, 16x16x2 patches); milliseconds per call (mean of 30 after 3 warm-ups):
- linears: `F.linear` vs oneDNN-packed weights (`vlmrun.layers.linear.linear`), qkv / gate_up / down
  at decode (M = 32) and prefill (M = 2,496) sizes, with the largest relative difference;
- page gather of a decode step's KV (32 sequences): advanced indexing (the torch backend's) vs
  `index_select` of whole pages (the CPU backend's);
- decode attention over the gathered pages: the masked GQA SDPA call of the torch backend vs the
  grouped call of the CPU backend (query heads of a KV head as its query rows);
- rotary: `x * cos + rotate_half(x) * sin` (HF's form) vs `vlmrun.layers.rotary.apply_rotary`;
- bf16 only: the vision patch embed as oneDNN's conv vs one GEMM (32 images of 224x224).
Packed linears are left out for a dtype this CPU's oneDNN cannot run (bf16 without AVX-512).

`--shapes`: F.linear vs packed float32 GEMMs from 128 x 384 to 12,288 x 2,048 weights (the bundled
model's up to Qwen3-VL-2B's) at M = 1, 8, 32 and 256 rows, in microseconds (mean of 200 after 10
warm-ups): where `cpu_kernels.PACK_THRESHOLD` comes from.

    python -m bench.bench_cpu_kernels [--shapes]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vlmrun.layers.cpu_kernels import cpu_features
from vlmrun.layers.packed_linear import onednn_linear, pack_weight
from vlmrun.layers.rotary import apply_rotary, prepared_tables

LINEARS = {"qkv": (1024, 512), "gate_up": (3072, 512), "down": (512, 1536)}  # (out, in)
HEADS, KV_HEADS, HEAD_DIM, PAGE, SEQS = 8, 4, 64, 16, 32


def per_call_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def row(what: str, old_name: str, old: float, new_name: str, new: float, extra: str = "") -> None:
    print(f"  {what:34s} {old_name} {old:8.3f} ms, {new_name} {new:8.3f} ms, {old / new:5.2f}x{extra}", flush=True)


def bench_linears(dtype: torch.dtype, gen: torch.Generator) -> None:
    if missing := cpu_features().cannot_pack(dtype):
        print(f"  linears: packed left out ({missing})")
        return
    for name, (out_features, in_features) in LINEARS.items():
        weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
        packed = pack_weight(weight)
        for rows in (32, 2496):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            ref = F.linear(x.float(), weight.float())
            rel = ((onednn_linear(x, packed).float() - ref).abs().max() / ref.abs().max()).item()
            row(f"linear {name} M={rows}", "F.linear", per_call_ms(lambda: F.linear(x, weight)),
                "packed", per_call_ms(lambda: onednn_linear(x, packed)), f", max rel diff {rel:.1e}")


def bench_decode_attention(dtype: torch.dtype, gen: torch.Generator) -> None:
    pool = torch.randn(22000 * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)  # one layer's K buffer
    pages = pool.view(-1, PAGE, KV_HEADS, HEAD_DIM)
    for keys in (96, 256):
        table = torch.randperm(22000, generator=gen)[: SEQS * keys // PAGE].view(SEQS, keys // PAGE)
        row(f"page gather, {keys} keys", "index", per_call_ms(lambda: pages[table]),
            "index_select", per_call_ms(lambda: torch.index_select(pages.view(pages.shape[0], -1), 0, table.flatten())))
        k = pages[table].flatten(1, 2).transpose(1, 2)  # [seqs, kv_heads, keys, head_dim]
        q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=gen).to(dtype)
        mask = (torch.arange(keys)[None, :] < torch.randint(keys - PAGE + 1, keys + 1, (SEQS, 1), generator=gen))
        masked = lambda: F.scaled_dot_product_attention(q[:, :, None], k, k, attn_mask=mask[:, None, None], enable_gqa=True)  # noqa: E731
        grouped = lambda: F.scaled_dot_product_attention(q.view(SEQS, KV_HEADS, -1, HEAD_DIM), k, k,  # noqa: E731
                                                         attn_mask=mask[:, None, None])
        row(f"decode attention, {keys} keys", "masked GQA", per_call_ms(masked), "grouped", per_call_ms(grouped))


def bench_rotary(dtype: torch.dtype, gen: torch.Generator) -> None:
    x = torch.randn(4126, HEADS, HEAD_DIM, generator=gen).to(dtype)
    cos, sin = torch.randn(4126, HEAD_DIM, generator=gen), torch.randn(4126, HEAD_DIM, generator=gen)

    def hf_form() -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(dtype)

    tables = prepared_tables(cos, sin)  # (made once a forward for every layer)
    row("rotary, 4,126 tokens", "rotate_half", per_call_ms(hf_form), "addcmul", per_call_ms(lambda: apply_rotary(x, *tables)))


def bench_patch_embed(gen: torch.Generator) -> None:
    from vlmrun.models.blocks.vision_common import VisionPatchEmbed

    embed = VisionPatchEmbed(3, 2, 16, 256, bias=True).to(torch.bfloat16)
    x = torch.randn(32 * 196, 3 * 2 * 16 * 16, generator=gen).bfloat16()
    conv = lambda: embed.proj(x.view(-1, *embed.proj.weight.shape[1:])).view(-1, 256)  # noqa: E731
    gemm = lambda: F.linear(x, embed.proj.weight.flatten(1), embed.proj.bias)  # noqa: E731
    row("patch embed, 32 images", "conv", per_call_ms(conv, 5), "GEMM", per_call_ms(gemm, 5))


GEMM_SHAPES = [(384, 128), (128, 384), (1024, 512), (3072, 512), (512, 1536), (4096, 2048), (12288, 2048),
               (2048, 6144)]  # (out, in)


def bench_gemm_shapes(gen: torch.Generator) -> None:
    for out_features, in_features in GEMM_SHAPES:
        weight = torch.randn(out_features, in_features, generator=gen)
        packed = pack_weight(weight)
        cells = []
        for rows in (1, 8, 32, 256):
            x = torch.randn(rows, in_features, generator=gen)
            plain = per_call_ms(lambda: F.linear(x, weight), 200) * 1e3
            fast = per_call_ms(lambda: onednn_linear(x, packed), 200) * 1e3
            cells.append(f"M={rows}: {plain:8.1f} / {fast:8.1f} us {fast / plain:4.2f}x")
        print(f"  {out_features:5d} x {in_features:5d}  " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", action="store_true", help="float32 F.linear vs packed over weight sizes")
    args = parser.parse_args()
    print(f"CPU: {cpu_features().describe()}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    if args.shapes:
        print("float32 GEMM, F.linear / packed (weight out x in)", flush=True)
        with torch.inference_mode():
            bench_gemm_shapes(gen)
        return
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            print(str(dtype)[6:], flush=True)
            bench_linears(dtype, gen)
            bench_decode_attention(dtype, gen)
            bench_rotary(dtype, gen)
        bench_patch_embed(gen)


if __name__ == "__main__":
    main()
