"""The CPU attention backend's forward in a speculative-decoding verify step, and the torch reference's.

A verify step of N requests (default 256), each with ~100 cached tokens (uniform in 90..110) feeding
its last token and k drafts (default 3: 4 positions), at the bundled model's attention shapes
(4 query / 2 KV heads of 64, page 16), pages scattered over the pool. `--mixed` makes every fourth
request a plain decode (1 token) and every eighth one verifying fewer drafts, and adds one prefill
chunk over a cached prefix. Prints milliseconds per call (mean of `--calls` after warm-ups) of
`CpuAttnBackend.prepare` (once a step) and `.forward` (once a layer), and the torch reference
backend's forward as the peer measured in the same process.

Old vs new code: run this script from two checkouts in turn (`git archive REV | tar -x -C /tmp/REV`,
this file copied into each), e.g. under farm-bench's --vs, each run appending its lines to a file:
`farm-bench -n 5 --vs "sh -c 'cd /tmp/old && exec python -m bench.bench_cpu_verify_attention >>/tmp/old.log'"
-- sh -c 'cd /tmp/new && exec python -m bench.bench_cpu_verify_attention >>/tmp/new.log'`, and compare
the medians. The first line names the `vlmrun` imported and the CPU.

    python -m bench.bench_cpu_verify_attention [--requests 256] [--drafts 3] [--dtype float32] [--mixed]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import vlmrun
from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, token_slots
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16


def fed_tokens(requests: int, drafts: int, mixed: bool, rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """Per request: cached tokens before the step, tokens fed, drafts among them."""
    prefix, extend, num_drafts = [], [], []
    for i in range(requests):
        d = drafts if not mixed or i % 8 else rng.randint(1, drafts)
        d = 0 if mixed and i % 4 == 1 else d
        prefix.append(rng.randint(90, 110) + drafts - d)
        extend.append(1 + d)
        num_drafts.append(d)
    if mixed:  # one chunk of a prompt over its cached first half
        prefix.append(64)
        extend.append(64)
        num_drafts.append(0)
    return prefix, extend, num_drafts


def verify_step(requests: int, drafts: int, mixed: bool, dtype: torch.dtype) -> tuple[KVPool, ReqToTokenPool, ForwardBatch]:
    rng = random.Random(0)
    prefix, extend, num_drafts = fed_tokens(requests, drafts, mixed, rng)
    seq_lens = [p + n for p, n in zip(prefix, extend)]
    pages_each = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_each) + 1
    pool = KVPool(1, num_pages * PAGE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), PAGE)
    gen = torch.Generator().manual_seed(0)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen).to(dtype))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen).to(dtype))
    rows = ReqToTokenPool(len(seq_lens), max(seq_lens), torch.device("cpu"))
    free = list(range(1, num_pages))
    rng.shuffle(free)
    out_loc = []
    for row, (p, total, pages) in enumerate(zip(prefix, seq_lens, pages_each)):
        slots = torch.tensor(token_slots([free.pop() for _ in range(pages)], 0, total, PAGE), dtype=torch.int64)
        rows.req_to_token[row, :total] = slots
        out_loc.append(slots[p:])
    num_tokens = sum(extend)
    long = dict(dtype=torch.int64)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(3, num_tokens, **long),
        req_pool_indices=torch.arange(len(seq_lens)), seq_lens=torch.tensor(seq_lens),
        extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(extend),
        out_cache_loc=torch.cat(out_loc), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend, logits_indices=torch.zeros(0, **long), num_drafts_cpu=num_drafts)
    return pool, rows, fb


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def per_call_ms(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--mixed", action="store_true", help="plain decodes, shorter drafts and a prefill chunk too")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"vlmrun from {vlmrun.__file__}; CPU {cpu_name()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    with torch.inference_mode():
        for name, cls in (("cpu", CpuAttnBackend), ("torch", TorchAttnBackend)):
            pool, rows, fb = verify_step(args.requests, args.drafts, args.mixed, dtype)
            gen = torch.Generator().manual_seed(1)
            q = torch.randn(fb.num_tokens, HEADS * HEAD_DIM, generator=gen).to(dtype)
            k = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
            v = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
            backend = cls(pool, rows)
            fb.attn_backend = backend
            prepare = per_call_ms(lambda: backend.prepare(fb), max(10, args.calls // 5))
            forward = per_call_ms(lambda: backend.forward(q, k, v, layer, fb), args.calls)
            print(f"{name:5s} backend: {fb.batch_size} sequences, {fb.num_tokens} tokens, {args.dtype}: "
                  f"prepare {prepare:7.3f} ms, forward {forward:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
