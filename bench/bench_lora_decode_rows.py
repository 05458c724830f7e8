"""A LoRA engine's decode step, its plain decodes as `DecodeRows` columns against a chunk per request.

On a model whose compute is next to nothing (a random Qwen3-VL, one text layer of hidden 64, the tiny test
tokenizer) a decode step's time is the engine's host work. Three engines, alike but for this: `no LoRA`
(the base engine, for reference), `LoRA, chunks` (enable_lora with every decode a `ChunkInput`: what a LoRA
engine did before its decodes took the columns path; `Scheduler.decode_rows` switched off) and
`LoRA, rows` (enable_lora, decodes as `DecodeRows` with their adapters). The LoRA engines' requests
cycle over the base model and two adapters made by `peft` on every text linear (rank 8). Each run adds
`--batch` requests (prompts of 16 random ids, greedy, EOS ignored), runs the first step (the prefills)
untimed, then times `--steps` decode steps: ms/step, the median of `--repeats` rounds (modes alternate).
One torch thread (run it under OMP_NUM_THREADS=1 too).

    OMP_NUM_THREADS=1 python -m bench.bench_lora_decode_rows --batch 64 --steps 32 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import rotated
from testing.lora_adapters import TEXT_LINEARS, build_peft_adapter
from testing.tiny_models import build_tiny_checkpoint
from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import SamplingParams

MODES = ("no LoRA", "LoRA, chunks", "LoRA, rows")


def make_engine(model_dir: Path, mode: str, batch: int) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=batch,
                                 max_num_batched_tokens=max(2048, 16 * batch), enable_prefix_caching=False,
                                 enable_lora=mode != "no LoRA", max_loras=2, max_lora_rank=8))
    if mode == "LoRA, chunks":
        engine.scheduler.decode_rows = False  # before any request: every decode a chunk
    return engine


def ms_per_step(model_dir: Path, mode: str, batch: int, steps: int, adapters: list[LoRARequest]) -> float:
    engine = make_engine(model_dir, mode, batch)
    rng = random.Random(0)
    loras = [None] if mode == "no LoRA" else [None, *adapters]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(0, 500) for _ in range(16)]
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": prompt}), params,
                           lora_request=loras[i % len(loras)])
    engine.step()  # the prefills
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return 1000 * elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_checkpoint("qwen3_vl", Path(tmp) / "model", seed=0,
                                          overrides={"text": {"num_hidden_layers": 1}})
        adapters = [LoRARequest(f"a{i}", i, str(build_peft_adapter(model_dir, Path(tmp) / f"a{i}",
                                                                   target_modules=TEXT_LINEARS, r=8, seed=i)))
                    for i in (1, 2)]
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in rotated(MODES, r):
                times[mode].append(ms_per_step(model_dir, mode, args.batch, args.steps, adapters))
    print(f"| batch {args.batch}, {args.steps} decode steps | ms/step (median of {args.repeats}) | µs/request/step |")
    print("| --- | --- | --- |")
    for mode in MODES:
        ms = statistics.median(times[mode])
        print(f"| {mode} | {ms:.2f} | {1000 * ms / args.batch:.1f} |")


if __name__ == "__main__":
    main()
