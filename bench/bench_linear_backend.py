"""The dense linears as F.linear or oneDNN-packed, on this CPU, whole engine: what `linear_backend="auto"`
(`vlmrun/layers/cpu_kernels.py`, `PACK_THRESHOLD`) gives against packing none or all.

For each dtype, one engine per backend ("torch", "auto", and "onednn" where this CPU runs it) in one
process (the bundled default model, or the CPU bench's random-weight Qwen3-VL, bench/common.py, with
`--bench-model`), alternating rounds:
a decode step's time at batch B = (time of B text requests generating N + 1 tokens - time of the
same requests generating 1 token) / N, median over the rounds. Prints the CPU's model name and
torch's view of it (ATen capability, oneDNN bf16) first.

    python -m bench.bench_linear_backend [--batches 1 32] [--tokens 64] [--rounds 5] [--bench-model]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import build_checkpoint, hide_flash_linear_attention
from vlmrun import LLM, SamplingParams
from vlmrun.layers.cpu_kernels import cpu_features

PROMPT = "Describe the picture of the red circle and the blue square."


def run_seconds(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt": PROMPT, "images": []}] * batch, params, use_tqdm=False)  # one templated user turn
    return time.perf_counter() - start


def decode_step_ms(llms: dict[str, LLM], batch: int, tokens: int, rounds: int) -> dict[str, float]:
    for llm in llms.values():  # warm-up: first-call allocations, caches
        run_seconds(llm, batch, tokens + 1)
    steps: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            long, short = run_seconds(llm, batch, tokens + 1), run_seconds(llm, batch, 1)
            steps[name].append((long - short) / tokens * 1e3)
    return {name: statistics.median(ms) for name, ms in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bench-model", action="store_true",
                        help="the CPU bench's random-weight Qwen3-VL (hidden 512) instead of the bundled model")
    args = parser.parse_args()
    hide_flash_linear_attention()

    features = cpu_features()
    print(f"CPU: {features.describe()}; {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.bench_model:
            model = str(build_checkpoint(Path(tmp)))
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            backends = ["torch", "auto"] + (["onednn"] if features.cannot_pack(dtype) is None else [])
            llms = {b: LLM(model, dtype=name, device="cpu", linear_backend=b) for b in backends}
            weights = [m.weight for m in llms["auto"].engine.executor.model.modules()
                       if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]
            packed = sum(w.is_mkldnn for w in weights)
            print(f"{name}: auto packs {packed} of {len(weights)} 2-D weights"
                  + ("" if "onednn" in backends else f" (oneDNN cannot: {features.cannot_pack(dtype)})"), flush=True)
            for batch in args.batches:
                ms = decode_step_ms(llms, batch, args.tokens, args.rounds)
                line = ", ".join(f"{b} {value:.2f} ms" for b, value in ms.items())
                ratio = f"; onednn / torch {ms['onednn'] / ms['torch']:.2f}x" if "onednn" in ms else ""
                print(f"  decode step at batch {batch:3d}: {line}{ratio}", flush=True)
            del llms


if __name__ == "__main__":
    main()
