"""Prefix caching on CPU: time to first token of a multi-turn image chat, cache on vs off.

Builds the CPU bench's random-weight Qwen3-VL checkpoint (bench/common.py), then runs C conversations of
T turns each, one round at a time (all conversations' turn k together, as a chat server sees
them): turn 1 has an image and a question, every later turn sends the whole history (the image,
earlier questions and the engine's own answers) plus a new question. Each request's time to first
token (arrival to first sampled token) is measured inside the engine. The same workload runs
with `enable_prefix_caching=True` and `False` on fresh engines, each warmed up on other images
first; the median of --repeats runs is reported (hit counts are those of the timed runs).

    python -m bench.bench_prefix_cache --conversations 4 --turns 4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import add_threads_option, apply_threads, build_checkpoint, describe_cpu

SYSTEM = ("You are a meticulous visual assistant. Describe what you see precisely, name colours and shapes, "
          "and keep each answer short. ") * 3
QUESTIONS = ["What is in this picture?", "Which colour dominates?", "Is there any text visible?",
             "Describe the left half.", "Describe the right half.", "Summarise in five words."]


def image(seed: int, side: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8))


def run_chats(llm, conversations: int, turns: int, max_tokens: int, seed: int, side: int) -> list[list[float]]:
    """TTFT in seconds per round (turn) per conversation."""
    from vlmrun import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    histories = [[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": [{"type": "image", "image": image(seed + c, side)},
                                               {"type": "text", "text": QUESTIONS[0]}]}]
                 for c in range(conversations)]
    ttft: list[list[float]] = []
    for turn in range(turns):
        ids = []
        for c, hist in enumerate(histories):
            rid = f"s{seed}-c{c}-t{turn}"
            engine.add_request(rid, engine.process(hist), params)
            ids.append(rid)
        times: dict[str, float] = {}
        replies: dict[str, str] = {}
        while engine.has_unfinished():
            for update in engine.step():
                result = update.result
                if result is not None:
                    replies[update.request_id] = result.text
                    times[update.request_id] = result.first_token_time - result.arrival_time
        ttft.append([times[r] for r in ids])
        for c, (hist, rid) in enumerate(zip(histories, ids)):
            hist.append({"role": "assistant", "content": replies[rid]})
            hist.append({"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]})
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--image-side", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)

    from vlmrun import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        print(f"device: {describe_cpu()}")
        rows = {}
        for enabled in (False, True):
            llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=enabled)
            run_chats(llm, args.conversations, 2, args.max_tokens, seed=1000, side=args.image_side)  # warm-up
            first, later, walls = [], [], []
            warm = llm.engine.prefix_cache_stats()
            for r in range(args.repeats):
                start = time.perf_counter()
                ttft = run_chats(llm, args.conversations, args.turns, args.max_tokens, seed=r * 100,
                                 side=args.image_side)
                walls.append(time.perf_counter() - start)
                first.append(statistics.mean(ttft[0]))
                later.append(statistics.mean(t for round_ in ttft[1:] for t in round_))
            total = llm.engine.prefix_cache_stats()
            stats = dataclasses.replace(total, **{f: getattr(total, f) - getattr(warm, f)
                                                  for f in ("queries", "query_tokens", "hits", "hit_tokens",
                                                            "images_skipped")})
            rows[enabled] = (statistics.median(first), statistics.median(later), statistics.median(walls), stats)
            print(f"prefix caching {'on ' if enabled else 'off'}: TTFT turn 1 {rows[enabled][0] * 1e3:.1f} ms, "
                  f"turns 2-{args.turns} {rows[enabled][1] * 1e3:.1f} ms, workload {rows[enabled][2]:.2f} s, "
                  f"hit rate {stats.hit_rate:.1%} ({stats.hit_tokens}/{stats.query_tokens} prompt tokens, "
                  f"{stats.images_skipped} images skipped)")
        off, on = rows[False], rows[True]
        print(f"speed-up with the cache: TTFT turns 2-{args.turns} {off[1] / on[1]:.2f}x, "
              f"workload {off[2] / on[2]:.2f}x")


if __name__ == "__main__":
    main()
