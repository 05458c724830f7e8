"""The cost of LoRA rows against base rows at batch 32 on the CPU.

One engine per mode over the CPU bench checkpoint (`bench.common.build_checkpoint`: Qwen3-VL random
weights, text hidden 512, 6 layers), all alike but for LoRA, run alternately (`--repeats` rounds,
each starting at the next mode; median): `off` (no LoRA), `on, base rows` (LoRA enabled, no request names an adapter), `1 adapter`
(every row the same adapter: the two-matmul path), `4 adapters` (rows round-robin over four adapters
in four slots: the masked all-slot path) and `3 adapters + base`. The adapters are made by `peft` on
every text linear (q/k/v/o, gate/up/down) at `--rank`. Each run adds `--batch` text requests,
prefills them (untimed) and times `--steps` engine steps in which all of them decode (greedy,
ignore_eos): decode tok/s = batch * steps / the process's CPU seconds over them, with one torch thread
by default (`--threads`), so that other work on a shared machine does not enter the figure. Prints
a BENCHMARKS.md table.

    python -m bench.bench_lora [--batch 32] [--steps 16] [--rank 16] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import (add_threads_option, apply_threads, build_checkpoint, describe_run, hide_flash_linear_attention,
                          make_requests, rotated)
from testing.lora_adapters import build_peft_adapter

TEXT_LINEARS_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MODES = ("off", "on, base rows", "1 adapter", "4 adapters", "3 adapters + base")


def loras_for(mode: str, n: int, adapters: list) -> list:
    """Each row's LoRARequest (None: the base model) in `mode`."""
    if mode in ("off", "on, base rows"):
        return [None] * n
    if mode == "1 adapter":
        return [adapters[0]] * n
    if mode == "4 adapters":
        return [adapters[i % 4] for i in range(n)]
    return [None if i % 4 == 3 else adapters[i % 4] for i in range(n)]


def decode_rate(llm, prompts: list[str], steps: int, loras: list) -> float:
    """Decode tokens per CPU second of the batch: every request is added and prefilled (untimed), then
    `steps` engine steps in which every row decodes one token are timed (process CPU time); the requests
    are aborted after."""
    from vlmrun import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, engine.process({"prompt": prompt, "images": []}), params, lora_request=lora)
    while any(not engine.requests[rid].output_token_ids for rid in ids):
        engine.step()
    start = time.process_time()  # this process's CPU time: steadier than the wall clock on a shared machine
    for _ in range(steps):
        engine.step()
    seconds = time.process_time() - start
    assert all(len(engine.requests[rid].output_token_ids) >= steps for rid in ids)
    for rid in ids:
        engine.abort(rid)
    return len(prompts) * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_option(parser, default=1)
    args = parser.parse_args()
    apply_threads(args)
    hide_flash_linear_attention()
    from vlmrun import LLM, LoRARequest

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / "model")
        adapters = [LoRARequest(f"a{i}", i + 1, str(build_peft_adapter(
            model_dir, Path(tmp) / f"a{i}", target_modules=TEXT_LINEARS_REGEX, r=args.rank, lora_alpha=2 * args.rank,
            seed=i))) for i in range(4)]
        _, prompts, _ = make_requests(args.batch, "text", seed=0, max_tokens=1)
        common = dict(dtype="float32", device="cpu", max_num_seqs=args.batch, enable_prefix_caching=False)
        engines = {"off": LLM(str(model_dir), **common)}
        lora_llm = LLM(str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
        engines.update({m: lora_llm for m in MODES[1:]})
        decode: dict[str, list[float]] = {m: [] for m in MODES}
        for mode in MODES:  # warm-up: every adapter in its slot, first-call costs paid
            decode_rate(engines[mode], prompts, 2, loras_for(mode, args.batch, adapters))
        for r in range(args.repeats):
            for mode in rotated(MODES, r):
                decode[mode].append(decode_rate(engines[mode], prompts, args.steps, loras_for(mode, args.batch, adapters)))
    base = statistics.median(decode["off"])
    print(f"{describe_run('bench.bench_lora')}")
    print("| mode | decode tok per CPU s (median) | vs LoRA off |")
    print("| --- | --- | --- |")
    for mode in MODES:
        rate = statistics.median(decode[mode])
        print(f"| {mode} | {rate:.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
