"""Greedy token choice on the CPU: `torch.argmax(logits, dim=-1)` against `vlmrun.layers.argmax.last_dim_argmax`.

Float32 logits [rows, vocab] of random normal values, one thread; microseconds per call (median of
`--repeats` timings, each the mean of enough calls for about 50 ms) at the host-overhead bench's shape
(vocab 512) and Qwen's real vocabularies (151,936; 248,320), batch 1, 64 and 256, with each call's result
checked equal to torch.argmax's.

    python -m bench.bench_argmax [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlmrun.layers.argmax import MIN_ELEMENTS, block_width, last_dim_argmax

SHAPES = [(rows, vocab) for vocab in (512, 151936, 248320) for rows in (1, 64, 256)]


def per_call_us(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    start = time.perf_counter()
    fn(x)
    calls = max(1, int(0.05 / max(time.perf_counter() - start, 1e-7)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'rows':>5} {'vocab':>7} {'width':>5} {'torch.argmax us':>16} {'last_dim_argmax us':>19} {'ratio':>6}")
    for rows, vocab in SHAPES:
        x = torch.randn(rows, vocab, generator=gen)
        if not torch.equal(last_dim_argmax(x), x.argmax(dim=-1)):
            raise SystemExit(f"last_dim_argmax differs from torch.argmax at [{rows}, {vocab}]")
        plain = per_call_us(lambda t: t.argmax(dim=-1), x, args.repeats)
        blocked = per_call_us(last_dim_argmax, x, args.repeats)
        width = block_width(vocab) if rows * vocab >= MIN_ELEMENTS else None  # (None: the plain argmax runs)
        print(f"{rows:>5} {vocab:>7} {width or '-':>5} {plain:>16.1f} {blocked:>19.1f} {plain / blocked:>6.2f}",
              flush=True)


if __name__ == "__main__":
    main()
