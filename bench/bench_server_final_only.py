"""Many concurrent non-streamed completions against the server in this process: final-only against streamed.

The server's non-streamed requests are added to the engine final-only (`stream=False`: no per-step
update, text delta, `ChoiceDelta` or event-loop wake-up per request; the answer handed over once, at its
end). This times `--concurrency` concurrent non-streamed `/v1/completions` (prompts of 16 random token ids,
`--max-tokens` greedy tokens, EOS ignored) on the host-overhead bench's checkpoint (a random Qwen3-VL with
one text layer of hidden 64, so a step's time is the engine's and the server's host work), served by
`vlmrun serve`'s app on 127.0.0.1 in this process (the client is an `httpx.AsyncClient` on the main
thread), two ways, alternating per repeat:

- **final**: as the server adds them now (`AsyncEngine.submit(stream=False)`);
- **stream**: every group submitted streamed (`stream=True`), as the server added them before: the
  engine makes each request's update and text delta every step and the event loop takes them.

Per way: requests/s and generated tokens/s (the batch's wall time, first request sent to last answer),
the wall time per engine step (over the engine steps the batch took, from the stats snapshot: what a step
costs the whole process, HTTP and event loop included) and the time inside `Engine.step` per step
(the engine's own work, the output processor's included); medians over `--repeats`, with each repeat's
stream/final wall-time ratio.

    OMP_NUM_THREADS=1 python -m bench.bench_server_final_only [--concurrency 64 256] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

PROMPT_LEN = 16
MODEL = "m"


def build_checkpoint(out_dir: Path) -> Path:
    """The host-overhead bench's checkpoint: a 1-layer, hidden-64 random Qwen3-VL (vocab 512)."""
    from testing.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3_vl", out_dir, seed=0, overrides={"text": {"num_hidden_layers": 1}})


class StepClock:
    """`Engine.step` timed (the engine thread's step: scheduling, the forward, the output processor)."""

    def __init__(self, engine: Engine):
        self.step, self.seconds = engine.step, 0.0
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> Any:
        start = time.perf_counter()
        try:
            return self.step()
        finally:
            self.seconds += time.perf_counter() - start


class ForceStream:
    """`AsyncEngine.submit` with every group streamed (the server's way before final-only) while `on`."""

    def __init__(self, engine: AsyncEngine):
        self.submit, self.on = engine.submit, False
        engine.submit = self  # type: ignore[method-assign]

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on:
            kwargs["stream"] = True
        return await self.submit(*args, **kwargs)


async def one_batch(base_url: str, concurrency: int, max_tokens: int, seed: int) -> float:
    """Send `concurrency` completions at once; the seconds until the last answer came."""
    rng = random.Random(seed)
    bodies = [{"model": MODEL, "prompt": [rng.randrange(0, 500) for _ in range(PROMPT_LEN)], "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True} for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        elapsed = time.perf_counter() - start
    for answer in answers:
        answer.raise_for_status()
        assert answer.json()["usage"]["completion_tokens"] == max_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        engine = AsyncEngine(Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                                 max_num_seqs=max(args.concurrency), enable_prefix_caching=False,
                                                 max_model_len=512, kv_cache_memory_bytes=256 << 20))).start()
        force, clock = ForceStream(engine), StepClock(engine.engine)
        server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, log_stats=False))
        try:
            asyncio.run(one_batch(server.base_url, 8, 4, seed=99))  # warm-up
            for concurrency in args.concurrency:
                results: dict[str, list[tuple[float, int, float]]] = {"final": [], "stream": []}
                for repeat in range(args.repeats):
                    order = ["final", "stream"] if repeat % 2 == 0 else ["stream", "final"]
                    for way in order:
                        force.on = way == "stream"
                        steps, in_steps = engine.stats.num_steps, clock.seconds
                        elapsed = asyncio.run(one_batch(server.base_url, concurrency, args.max_tokens, seed=repeat))
                        results[way].append((elapsed, engine.stats.num_steps - steps, clock.seconds - in_steps))
                report(concurrency, args.max_tokens, results)
        finally:
            server.stop()
            engine.shutdown()


def report(concurrency: int, max_tokens: int, results: dict[str, list[tuple[float, int, float]]]) -> None:
    print(f"concurrency {concurrency}, {max_tokens} tokens each:")
    for way, runs in results.items():
        wall = statistics.median(e for e, _, _ in runs)
        per_step = statistics.median(1e3 * e / max(s, 1) for e, s, _ in runs)
        in_step = statistics.median(1e3 * t / max(s, 1) for _, s, t in runs)
        print(f"  {way:6s}: {concurrency / wall:8.1f} requests/s, {concurrency * max_tokens / wall:9.0f} tokens/s, "
              f"{per_step:6.2f} ms wall / engine step, {in_step:6.2f} ms in Engine.step "
              f"(median of {len(runs)}; steps {[s for _, s, _ in runs]})")
    ratios = [s[0] / f[0] for f, s in zip(results["final"], results["stream"])]
    print(f"  stream wall / final wall per repeat: {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)


if __name__ == "__main__":
    main()
