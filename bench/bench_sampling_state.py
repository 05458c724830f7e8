"""A step's sampling batch: rebuilt from the rows (`SamplingBatch.build`) vs gathered from the runner's
persistent per-row state (`SamplingState.gather` + `record`), milliseconds per step.

--batch requests, each with a prompt of --history tokens, decode --steps steps (one output appended per
step, outside the timing). Two mixes: `plain` (greedy and sampled rows with temperature / top-k / top-p /
logprobs, no penalties) and `penalties` (every row with repetition, frequency and presence penalties).
The state's first step writes every row (the admission); the figure is the median over the later
steps. On the CPU the tensor work runs on the host too: a small --vocab shows the host (Python) part,
a real one (151936, Qwen's) adds the `[batch, vocab]` tensor work both pay.

    python -m bench.bench_sampling_state --batch 256 --history 2000 --vocab 1024

`--engine` times whole decode steps instead: an `Engine` on bench_host_overhead's next-to-no-compute
checkpoint (1-layer Qwen3-VL, vocab 512), --batch requests with prompts of --history random ids, greedy,
without and with penalties (repetition 1.2, frequency 0.3, presence 0.2), ms per decode step (the steps
after the one that prefills every prompt). Run it on an older checkout (PYTHONPATH) for the "before".

    OMP_NUM_THREADS=1 python -m bench.bench_sampling_state --engine --batch 64 --history 400 --steps 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.sampling_params import SamplingParams


def make_rows(mix: str, batch: int, history: int, vocab: int, rng: random.Random) -> list[SamplingRow]:
    if mix == "penalties":
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, repetition_penalty=1.2, frequency_penalty=0.3,
                                 presence_penalty=0.2) for i in range(batch)]
    else:
        params = [SamplingParams(temperature=0.0) if i % 3 == 0 else
                  SamplingParams(temperature=0.8, top_k=50, top_p=0.9, logprobs=1 if i % 5 == 0 else None)
                  for i in range(batch)]
    return [SamplingRow(p, [rng.randrange(vocab) for _ in range(history)], [], None, [0]) for p in params]


def time_steps(mix: str, how: str, args: argparse.Namespace) -> float:
    """Median milliseconds per step after the first."""
    from vlmrun.layers.sampling_state import SamplingState  # (here: --engine also runs on older checkouts)

    rng = random.Random(0)
    rows = make_rows(mix, args.batch, args.history, args.vocab, rng)
    state = SamplingState(args.batch + 1, "cpu")
    page_rows = list(range(args.batch))
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch,))
        start = time.perf_counter()
        if how == "build":
            SamplingBatch.build(rows, args.vocab)
        else:
            state.record(state.gather(page_rows, rows, args.vocab), tokens)
        times.append(time.perf_counter() - start)
        for row, token in zip(rows, tokens.tolist()):
            row.output_token_ids.append(token)
    return 1000 * statistics.median(times[1:])


def time_engine(penalties: bool, args: argparse.Namespace, model_dir: Path) -> float:
    """ms per decode step of an Engine decoding --steps tokens for --batch requests."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=args.batch,
                                 enable_prefix_caching=False, max_model_len=args.history + args.steps + 16,
                                 max_num_batched_tokens=args.batch * args.history,
                                 kv_cache_memory_bytes=512 * 1024 * 1024))
    extra = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2) if penalties else {}
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True, **extra)
    rng = random.Random(0)
    for i in range(args.batch):
        ids = [rng.randrange(0, 500) for _ in range(args.history)]
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": ids}), params)
    engine.step()  # every prompt, and the first tokens
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return elapsed / steps * 1e3


def engine_main(args: argparse.Namespace) -> None:
    from testing.tiny_models import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:  # bench_host_overhead's checkpoint
        model_dir = build_tiny_checkpoint("qwen3_vl", Path(tmp), seed=0, overrides={"text": {"num_hidden_layers": 1}})
        print(f"engine, batch {args.batch}, prompts of {args.history}, {args.steps} tokens: ms per decode step")
        for penalties in (False, True):
            print(f"{'penalties' if penalties else 'greedy':10s} {time_engine(penalties, args, model_dir):8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--history", type=int, default=2000, help="prompt tokens of each request")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", action="store_true", help="time an Engine's decode steps instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_main(args)
        return
    print(f"batch {args.batch}, history {args.history}, vocab {args.vocab}: ms per step (median of {args.steps - 1})")
    for mix in ("plain", "penalties"):
        build, gather = time_steps(mix, "build", args), time_steps(mix, "gather", args)
        print(f"{mix:10s} build {build:8.3f}   state {gather:8.3f}   ({build / gather:.1f}x)")


if __name__ == "__main__":
    main()
