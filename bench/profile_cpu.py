"""Where vlmrun's CPU time goes: a step-phase split and torch.profiler's top operators.

Runs a 32-request workload of the CPU bench (bench/common.py; default `uniform`: one 224x224 image
and 32 output tokens each) on its random-weight Qwen3-VL and splits wall time into: vision encoder,
text-model forward of prefill steps and of decode steps, logits + sampling, and everything else (scheduler,
batch building, detokenizing: host work). Then it profiles one more run with torch.profiler and
prints the operators with the most self CPU time, and the share of attention's SDPA calls.

    python -m bench.profile_cpu --dtype float32 [--workload uniform|mixed|text] [--enforce-eager]
        [--option attention_backend=torch --option linear_backend=torch]  # the reference kernels
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import (DTYPES, WORKLOADS, build_checkpoint, engine_option, generate_timed,
                          hide_flash_linear_attention, make_requests)


class PhaseTimer:
    """Wall time of named phases, by wrapping methods (nested phases are not subtracted)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, attr: str, name_of) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                name = name_of(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(obj, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--workload", default="uniform", choices=WORKLOADS)
    parser.add_argument("--option", action="append", default=[], metavar="OPTION=VALUE",
                        help="an engine option, e.g. attention_backend=torch linear_backend=torch (the reference)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    hide_flash_linear_attention()
    from vlmrun import LLM
    from vlmrun.executor import model_runner  # (its build_forward_batch: executor/step_batch.py)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        options = {k: v for option in args.option for k, v in engine_option(option).items()}
        llm = LLM(str(model_dir), dtype=args.dtype, device="cpu", enforce_eager=args.enforce_eager, **options)
        runner = llm.engine.executor  # the in-process ModelRunner

        def run(seed: int) -> float:
            return generate_timed(llm, *make_requests(args.requests, args.workload, seed, args.max_tokens))[0]

        run(1000)  # warm-up
        timer = PhaseTimer()
        timer.wrap(runner, "forward", lambda fb: f"text forward {fb.mode.name.lower()}")
        timer.wrap(runner, "embed_images", lambda fb, chunks, *rest, **kw: "vision (embed_images)")
        timer.wrap(runner.model, "compute_logits", lambda h: "logits")
        timer.wrap(runner.sampler, "sample", lambda logits, batch: "sampling")
        timer.wrap(model_runner, "build_forward_batch", lambda *args, **kw: "build_forward_batch")
        total = run(1001)
        print(f"{args.dtype}, enforce_eager={args.enforce_eager}: {args.requests} requests in {total:.2f} s "
              f"({args.requests / total:.2f} req/s)")
        accounted = 0.0
        for name, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
            accounted += s
            print(f"  {name:28s} {s * 1000:8.0f} ms  {100 * s / total:5.1f} %  ({timer.calls[name]} calls, "
                  f"{s / timer.calls[name] * 1000:.2f} ms each)")
        print(f"  {'rest (scheduler, host)':28s} {(total - accounted) * 1000:8.0f} ms  "
              f"{100 * (total - accounted) / total:5.1f} %")

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(1002)
        table = prof.key_averages()
        total_us = sum(e.self_cpu_time_total for e in table)
        print(f"torch.profiler, self CPU time by operator (total {total_us / 1e6:.2f} s; profiler overhead included):")
        for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            print(f"  {e.key:48s} {e.self_cpu_time_total / 1000:8.0f} ms  {100 * e.self_cpu_time_total / total_us:5.1f} %"
                  f"  {e.count:7d} calls")


if __name__ == "__main__":
    main()
