"""bench/bench_gpu.py's decode section on the CPU: one set of figures per batch size, named by it
(batch 1 keeps the plain names the report reads), each yielded as soon as measured, and the batch
sizes past the time limit skipped and said so (the GPU acceptance run keeps what was measured)."""

from __future__ import annotations

import argparse
import time

from bench.bench_gpu import Seeds, measure_decode_batches


class CountingSide:
    """A side whose run takes a little longer per output token, so steps are measurable."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, images: list, max_tokens: int) -> int:
        self.batches.append(len(images))
        time.sleep(0.01 * max_tokens)
        return len(images) * max_tokens


def args(deadline: float) -> argparse.Namespace:
    return argparse.Namespace(decode_batches=[1, 2, 4], decode_tokens=4, repeats=1, deadline=deadline, time_limit_s=9)


def test_each_batch_size_gets_its_figures():
    side = CountingSide()
    parts = list(measure_decode_batches(side, Seeds(), args(time.monotonic() + 600)))
    assert [sorted(p) for p in parts] == [
        ["decode_step_ms", "decode_tok_s", "prefill_1_token_s"],
        ["decode_step_ms_b2", "decode_tok_s_b2", "prefill_1_token_s_b2"],
        ["decode_step_ms_b4", "decode_tok_s_b4", "prefill_1_token_s_b4"]]
    assert side.batches == [1] * 4 + [2] * 4 + [4] * 4  # (repeats + 1) runs of 1 token, then of N + 1
    assert parts[2]["decode_tok_s_b4"] > 2 * parts[0]["decode_tok_s"]  # 4 tokens a step, about the same step time


def test_batch_sizes_past_the_time_limit_are_skipped():
    parts = list(measure_decode_batches(CountingSide(), Seeds(), args(time.monotonic() - 1)))
    assert parts == [{f"decode_b{b}_skipped": "past --time-limit-s 9"} for b in (1, 2, 4)]
