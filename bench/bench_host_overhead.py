"""The engine's own host work per decode step: ms per step on a model whose compute is next to nothing.

The checkpoint is built here (`build_checkpoint`): a random Qwen3-VL with one text layer of hidden 64
(the tiny test tokenizer, vocab 512), so a decode step's time is the engine's host work (scheduling,
inputs, sampling settings, detokenization, bookkeeping) and the few small ops of the forward. Each side
decodes `--max-tokens` greedy tokens (EOS ignored) for a batch of identical-length prompts (random ids),
one thread (`torch.set_num_threads(1)`; run it under OMP_NUM_THREADS=1 too):

- **vlmrun**: an `Engine` (CPU, float32, no prefix caching so that the prompts are computed, eager
  decode); the requests are added as `LLM.generate` adds them (`stream=False`: the consumer reads only
  each request's result, so a step makes no per-request update or text), the first step prefills them
  all and samples their first token, then the remaining steps (decode only) are timed: ms/step = their
  time / their number. Every finished request's text is read inside the timed steps (its final
  detokenization runs in the step that finishes it, as in use). `--stream` adds them as the server's
  streamed requests instead (`stream=True`: each step's update and text delta per request) and reads
  each step's deltas.
- **HF transformers** `generate` on the same checkpoint and prompts (greedy, `min_new_tokens` =
  `max_new_tokens`, the default dynamic cache): ms/step = (time of `max_tokens` new tokens - time of
  one) / (`max_tokens` - 1), which leaves the prefill out the same way; each call ends with the texts
  (`tokenizer.batch_decode` of the new tokens), as HF's users get them.

vLLM's CPU build is not a side here (bench/vllm_side.py says how it was installed for
bench_cpu_vs_hf; it needs its own venv of about 3 GB). Each batch size runs `--repeats` times per
side, alternating (each side first in every other repeat), and the median is reported, with µs per request
per step (ms/step / batch); with both sides and 4+ repeats also vlmrun's time over HF's repeat by repeat (the
two ran back to back, so a slower phase of a shared machine hits both): its median and quartiles, and in how
many repeats vlmrun was faster (`--batches 256 --repeats 30`: the steadiest comparison on a noisy machine).
`--profile B` runs cProfile over vlmrun's timed steps at batch B and prints the top functions.

    OMP_NUM_THREADS=1 python -m bench.bench_host_overhead --batches 1 64 256 --max-tokens 48
    OMP_NUM_THREADS=1 python -m bench.bench_host_overhead --batches 256 --repeats 1 --sides vlmrun --profile 256
    OMP_NUM_THREADS=1 python -m bench.bench_host_overhead --batches 256 --sides vlmrun --stream  # streamed requests
    OMP_NUM_THREADS=1 python -m bench.bench_host_overhead --batches 1 --repeats 5 --sides vlmrun --final-texts 256

`--clock cpu` times with this process's CPU time instead of the wall clock: on a machine other work
loads, the figures move less (the quiet machine's wall clock stays the one to report).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.sampling_params import SamplingParams

PROMPT_LEN = 16


def build_checkpoint(out_dir: Path) -> Path:
    """A 1-layer, hidden-64 random Qwen3-VL (vocab 512, the tiny test tokenizer) in `out_dir`."""
    from testing.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3_vl", out_dir, seed=0, overrides={"text": {"num_hidden_layers": 1}})


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of PROMPT_LEN random ordinary-token ids (the special tokens sit at the vocab's end)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, 500) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def make_engine(model_dir: Path, max_num_seqs: int) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                               enable_prefix_caching=False, max_model_len=512,
                               kv_cache_memory_bytes=256 * 1024 * 1024))


def run_vlmrun(engine: Engine, batch: int, max_tokens: int, profiler: cProfile.Profile | None = None,
               clock: Callable[[], float] = time.perf_counter, stream: bool = False) -> float:
    """ms per decode step: the steps after the one that prefills every prompt (timed by `clock`). Each
    finished request's text is read in the timed loop (`stream`: each step's text deltas too)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts(batch)):
        engine.add_request(f"r{i}", engine.process({"prompt_token_ids": ids}), params, stream=stream)
    engine.step()  # every prompt in one step (batch * PROMPT_LEN <= max_num_batched_tokens), first tokens
    steps = chars = finished = 0
    if profiler is not None:
        profiler.enable()
    start = clock()
    while engine.has_unfinished():
        for update in engine.step():
            chars += len(update.text_delta)  # (empty without `stream`)
            if update.result is not None:
                finished += 1
                chars += len(update.result.text)
        steps += 1
    elapsed = clock() - start
    if profiler is not None:
        profiler.disable()
    if steps != max_tokens - 1 or finished != batch:
        raise RuntimeError(f"expected {max_tokens - 1} decode steps and {batch} results, ran {steps}, got {finished}")
    return elapsed / steps * 1e3


def run_hf(model, tokenizer, batch: int, max_tokens: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """ms per decode step of HF `generate` and the texts (`batch_decode` of the new tokens, as HF's users get
    text): (max_tokens new tokens - one new token) / (max_tokens - 1)."""
    input_ids = torch.tensor(prompts(batch), dtype=torch.int64)
    mask = torch.ones_like(input_ids)

    def timed(n: int) -> float:
        start = clock()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
        return clock() - start

    return (timed(max_tokens) - timed(1)) / (max_tokens - 1) * 1e3


def final_texts(tokenizer, batch: int, max_tokens: int, repeats: int) -> str:
    """A finished final-only request's text (`FinalOutput.final_text`, what a finishing row costs the step that
    ends it) against HF's `batch_decode` of the same ids, µs per request, median of `repeats` passes: `batch`
    prompts as the steps have them, outputs of `max_tokens` random ids (most texts hold U+FFFD), each finished
    by its length; the texts checked equal to the streamed path's (`OutputTextStream`, token by token) first."""
    from vlmrun.engine.detokenizer import OutputTextStream
    from vlmrun.engine.final_output import FinalOutput

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    asks = [(p, [rng.randrange(0, 500) for _ in range(max_tokens)]) for p in prompts(batch)]

    def finished(prompt: list[int], ids: list[int]) -> FinalOutput:
        final = FinalOutput(tokenizer, prompt, params, [], None)
        final.finish_reason(ids)
        return final

    for prompt, ids in asks:
        stream = OutputTextStream(tokenizer, prompt, params, [], None)
        for token_id in ids:
            stream.add_token(token_id)
        if finished(prompt, ids).final_text(ids)[0] != stream.text:
            raise RuntimeError(f"final_text differs from the streamed text for {ids}")
    ours, hf = [], []
    for _ in range(repeats):
        finals = [finished(prompt, ids) for prompt, ids in asks]
        start = time.perf_counter()
        for final, (_, ids) in zip(finals, asks):
            final.final_text(ids)
        ours.append((time.perf_counter() - start) / batch * 1e6)
        start = time.perf_counter()
        tokenizer.batch_decode([ids for _, ids in asks], skip_special_tokens=True)
        hf.append((time.perf_counter() - start) / batch * 1e6)
    return (f"final texts, {batch} requests of {max_tokens} random tokens, µs a request (median of {repeats}): "
            f"FinalOutput.final_text {statistics.median(ours):.1f}, HF batch_decode {statistics.median(hf):.1f}")


def pair_ratios(times: dict[str, list[float]]) -> str:
    """With both sides and 4+ repeats: vlmrun's time over HF's in the same repeat (the two ran back to back, so
    a slow phase of the machine hits both), median and quartiles, and in how many repeats vlmrun was faster."""
    if len(times) < 2 or len(times["vlmrun"]) < 4:
        return ""
    ratios = [v / h for v, h in zip(times["vlmrun"], times["hf"])]
    low, mid, high = statistics.quantiles(ratios, n=4)
    return (f"   vlmrun/hf per repeat: median {statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f}), "
            f"vlmrun faster in {sum(r < 1 for r in ratios)}/{len(ratios)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=["vlmrun", "hf"], choices=["vlmrun", "hf"])
    parser.add_argument("--profile", type=int, default=None, help="cProfile vlmrun's decode steps at this batch")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse (or build into) this folder")
    parser.add_argument("--stream", action="store_true",
                        help="add vlmrun's requests as streamed ones (each step's update and text delta), "
                             "not final-only")
    parser.add_argument("--final-texts", type=int, default=None, metavar="B",
                        help="also time B finished requests' texts against HF's batch_decode (µs a request)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (time.process_time), steadier on a machine others load")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "host-overhead-qwen3vl"
        if not (model_dir / "config.json").exists():
            build_checkpoint(model_dir)
        engine = make_engine(model_dir, max(*args.batches, 4))  # (the warm-up runs 4 requests at once)
        hf = None
        if "hf" in args.sides:
            from transformers import AutoModelForImageTextToText, AutoTokenizer

            hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        run_vlmrun(engine, 4, 4, stream=args.stream)  # warm-up: first calls of every path
        if hf is not None:
            run_hf(hf, hf_tokenizer, 4, 4)
        print(f"ms per decode step (median of {args.repeats}, {args.clock} clock), {args.max_tokens} greedy tokens, "
              f"prompts of {PROMPT_LEN} tokens, one thread; vlmrun's requests "
              f"{'streamed' if args.stream else 'final-only, as LLM.generate'}")
        print(f"{'batch':>6} " + " ".join(f"{side:>10} {'us/req':>8}" for side in args.sides))
        for batch in args.batches:
            times: dict[str, list[float]] = {side: [] for side in args.sides}
            for repeat in range(args.repeats):  # the sides alternate, each first in every other repeat
                for side in (args.sides if repeat % 2 == 0 else args.sides[::-1]):
                    times[side].append(run_vlmrun(engine, batch, args.max_tokens, clock=clock, stream=args.stream)
                                       if side == "vlmrun" else run_hf(hf, hf_tokenizer, batch, args.max_tokens, clock=clock))
            cells = []
            for side in args.sides:
                ms = statistics.median(times[side])
                cells.append(f"{ms:>10.2f} {ms / batch * 1e3:>8.1f}")
            print(f"{batch:>6} " + " ".join(cells) + pair_ratios(times), flush=True)
        if args.final_texts is not None:
            from transformers import AutoTokenizer

            print(final_texts(AutoTokenizer.from_pretrained(str(model_dir)), args.final_texts, args.max_tokens,
                              args.repeats), flush=True)
        if args.profile is not None:
            profiler = cProfile.Profile()
            ms = run_vlmrun(engine, args.profile, args.max_tokens, profiler, stream=args.stream)
            print(f"\ncProfile of vlmrun at batch {args.profile}: {ms:.2f} ms/step (under the profiler)")
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
            print(out.getvalue())
        engine.shutdown()


if __name__ == "__main__":
    main()
