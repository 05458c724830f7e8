"""`StatsLog`: the server's periodic engine statistics line (vLLM logs one every 10 s unless
`--disable-log-stats`): prompt and generation throughput since the last line, requests running and
waiting, KV cache use and the prefix cache's hit rate. Nothing is logged while the server stays idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from vlmrun.engine.async_engine import AsyncEngineStats

logger = logging.getLogger("vlmrun.server.stats")


@dataclass
class _Seen:
    time: float
    prompt: int
    generation: int
    queried: int
    hits: int


class StatsLog:
    """Every `interval_s` seconds, one INFO line from `stats()` and the token totals `totals()` gives
    (prompt, generation)."""

    def __init__(self, stats: Callable[[], AsyncEngineStats], totals: Callable[[], tuple[int, int]],
                 interval_s: float = 10.0):
        self._stats = stats
        self._totals = totals
        self.interval_s = interval_s
        self._task: Optional[asyncio.Task] = None
        self._seen = self._now()

    def start(self) -> "StatsLog":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.line()
            if line is not None:
                logger.info("%s", line)

    def line(self) -> Optional[str]:
        """The statistics since the last line; None when nothing ran and nothing is waiting."""
        s, before, now = self._stats(), self._seen, self._now()
        self._seen = now
        idle = now.prompt == before.prompt and now.generation == before.generation
        if idle and s.num_running == 0 and s.num_waiting == 0:
            return None
        elapsed = max(now.time - before.time, 1e-9)
        queried = now.queried - before.queried
        hit_rate = f"{100.0 * (now.hits - before.hits) / queried:.1f}%" if queried else "n/a"
        return (f"engine: prompt {(now.prompt - before.prompt) / elapsed:.1f} tokens/s, generation "
                f"{(now.generation - before.generation) / elapsed:.1f} tokens/s; requests running {s.num_running}, "
                f"waiting {s.num_waiting}; KV cache {100.0 * s.kv_usage:.1f}% used; prefix cache hit rate {hit_rate}")

    def _now(self) -> _Seen:
        s = self._stats()
        prompt, generation = self._totals()
        return _Seen(time.monotonic(), prompt, generation, s.prefix_query_tokens, s.prefix_hit_tokens)
