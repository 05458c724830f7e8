"""One decode layer's attention on the CPU: the CPU backend with its decode rows' pages gathered for torch's SDPA,
against the same backend with the paged decode kernel (vlmrun/layers/attention/paged_decode.c) reading them in place.

Each shape is a decode step of `seqs` sequences whose lengths are spread over [max_len / 2, max_len], each on
pages scattered over a pool with room for twice their pages; one layer, `backend.prepare(fb)` then
`backend.forward(q, k, v, layer, fb)` (its KV writes included; `prepare` runs once a step in a model, here once
a layer: it makes the gathering path's masks, a little more of its time), as the model's attention layer runs it. The two
outputs are checked equal (to float rounding) first. Microseconds per layer (median of `--repeats` timings,
each the mean of enough calls for about 0.2 s), one thread unless `--threads`:

- `host-overhead`: bench_host_overhead.py's model (2 KV heads of 16, 4 query heads), batch 256, 64 tokens;
- `bundled`: the bundled shapes model's full-attention layers (2 KV heads of 64, 4 query heads), batch 32, 320;
- `qwen3-vl-2b`: Qwen3-VL-2B's (8 KV heads of 128, 16 query heads), batch 16, 1,024 tokens;
- `qwen2.5-vl-7b`: Qwen2.5-VL-7B's (4 KV heads of 128, 28 query heads), batch 16, 2,048 tokens.

    python -m bench.bench_paged_decode [--dtype float32 bfloat16] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.paged_decode import load_paged_decode

PAGE = 16
SHAPES = {  # name -> (seqs, max_len, kv_heads, query heads, head_dim)
    "host-overhead": (256, 64, 2, 4, 16),
    "bundled": (32, 320, 2, 4, 64),
    "qwen3-vl-2b": (16, 1024, 8, 16, 128),
    "qwen2.5-vl-7b": (16, 2048, 4, 28, 128),
}


def decode_step(seqs: int, max_len: int, kv_heads: int, heads: int, head_dim: int, dtype: torch.dtype):
    """A pool, its page table and a decode step's ForwardBatch and q/k/v, on scattered pages."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(max_len // 2, max_len + 1, (seqs,), generator=gen).tolist()  # after this step
    pages_each = -(-max_len // PAGE)
    num_pages = 2 * seqs * pages_each + 1
    pool = KVPool(1, num_pages * PAGE, kv_heads, head_dim, dtype, torch.device("cpu"), page_size=PAGE)
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rows = ReqToTokenPool(seqs, max_len, torch.device("cpu"))
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # (page 0: the dummy's)
    slots = []
    for row, n in enumerate(lens):
        pages = [free.pop() for _ in range(-(-n // PAGE))]
        rows.req_to_token[row, :n] = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)])
        slots.append(int(rows.req_to_token[row, n - 1]))
    fb = ForwardBatch.build(input_ids=torch.zeros(seqs, dtype=torch.int64), positions=torch.zeros(3, seqs, dtype=torch.int64),
                            req_pool_indices=torch.arange(seqs), extend_prefix_lens=[n - 1 for n in lens],
                            extend_seq_lens=[1] * seqs, out_cache_loc=torch.tensor(slots),
                            logits_indices=torch.arange(seqs), to_device=lambda t: t)
    q = torch.randn(seqs, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(seqs, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(seqs, kv_heads * head_dim, generator=gen).to(dtype)
    return pool, rows, fb, (q, k, v)


def attention_layer(backend: CpuAttnBackend, fb: ForwardBatch, layer: Attention,
                    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One layer's attention over the step, as the model runs it: the metadata, then the layer."""
    backend.prepare(fb)
    return backend.forward(*qkv, layer, fb)


def per_call_us(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.2 / max(time.perf_counter() - start, 1e-7)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = load_paged_decode()
    if kernel is None:
        raise SystemExit("the paged decode kernel could not be built here (see the log line above)")
    print(f"one decode layer's attention, µs (median of {args.repeats}), {args.threads} thread(s); kernel {kernel.path.name}")
    print(f"{'shape':>14} {'dtype':>9} {'gathered+SDPA':>14} {'paged kernel':>13} {'ratio':>6}")
    for name in args.shapes:
        seqs, max_len, kv_heads, heads, head_dim = SHAPES[name]
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            pool, rows, fb, qkv = decode_step(seqs, max_len, kv_heads, heads, head_dim, dtype)
            layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, layer_id=0)
            sides = {"gathered": CpuAttnBackend(pool, rows), "paged": CpuAttnBackend(pool, rows, paged_decode=kernel)}
            steps = {side: functools.partial(attention_layer, backend, fb, layer, qkv) for side, backend in sides.items()}
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(steps["paged"]().float(), steps["gathered"]().float(), atol=tol, rtol=tol)
            us = {side: per_call_us(step, args.repeats) for side, step in steps.items()}
            print(f"{name:>14} {dtype_name:>9} {us['gathered']:>14.1f} {us['paged']:>13.1f} "
                  f"{us['paged'] / us['gathered']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
