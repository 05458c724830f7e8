"""The memory of a large request body handed back to the kernel after it: `MemoryTrimmer`.

A body of megabytes (a 50 MB prompt, base64 images) passes through the server as received chunks,
their join, the parsed JSON strings: transient blocks that glibc's malloc keeps once freed (the CPU
engine even asks it to keep every freed block, `executor/cpu_malloc.py`), so a few hostile bodies
would raise the server's RSS for good; so would the buffers of media refused half-way (a video's
container opened, then refused for its size). Once a body of at least `TRIM_BODY_BYTES` is parsed
(or one of `TRIM_REFUSED_BYTES` refused: hostile bodies of a few MB parse into 100k strings), and
after media preparation that failed or left the RSS `MEDIA_GROWTH_BYTES` above its last trim (a few
images of tens of megapixels: +8.8 GB), `delay_s` later (the request has let go of
it by then) `malloc_trim(0)` returns the free pages of every arena, in a pool thread and at most once
per `min_interval_s` (the engine's own freed blocks go too, and its next step faults them in again:
a cost paid only after large bodies), and once after each busy spell when the server has been idle for
`idle_s` (`trim_when_idle`). A no-op where the C library is not glibc.

`malloc_trim` cannot reach all of it, though: glibc gives each thread that allocates its own arena, and
it trims the free top of a thread's arena only past `M_TRIM_THRESHOLD`, which the CPU engine raises to
2 GiB (`cpu_malloc.py`); `malloc_trim` itself returns only the free blocks inside an arena, never its
top. A 50 MB body parsed in a pool thread ends up, freed, in that top and stays resident (one such
block per thread that ever parsed one: +120 MB after a few hostile bodies). So a server process
calls `share_one_arena()` before it starts any thread: every thread then allocates from the main
arena, whose free top `malloc_trim(0)` does return (`systrim`). Left alone where the user chose
(`MALLOC_ARENA_MAX`, a `glibc.malloc.arena_max` tunable, another allocator in `LD_PRELOAD`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import platform
import time
from concurrent.futures import Executor
from typing import Any, Callable, Optional

from vlmrun.executor.cpu_malloc import rss_bytes

logger = logging.getLogger(__name__)

TRIM_BODY_BYTES = 8 << 20
TRIM_REFUSED_BYTES = 1 << 20
MEDIA_GROWTH_BYTES = 64 << 20


def _glibc() -> Optional[Any]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


M_ARENA_MAX = -8  # mallopt parameter (glibc's malloc.h)
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def share_one_arena() -> bool:
    """Have every thread of this process allocate from glibc's main arena (call it before starting
    threads; arenas made before stay theirs); True if it was set, False where the user chose otherwise
    or the C library is not glibc."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))


class MemoryTrimmer:
    def __init__(self, pool: Executor, delay_s: float = 0.5, min_interval_s: float = 1.0, idle_s: float = 2.0,
                 media_growth_bytes: int = MEDIA_GROWTH_BYTES):
        self.pool = pool
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.idle_s = idle_s  # `trim_when_idle`: seconds without a request in flight before it trims
        self.media_growth_bytes = media_growth_bytes  # `after_media`: RSS growth over the last trim that trims
        self._libc = _glibc()
        self._scheduled = False
        self._last = 0.0
        self._floor = rss_bytes()  # the RSS after the last trim (or at start)
        self.trims = 0  # malloc_trim calls made (for tests and logs)

    def after_media(self) -> None:
        """Called on the event loop after a request's media were prepared: trim when the RSS has grown by
        `media_growth_bytes` since the last trim (images of tens of megapixels decode and resize through
        gigabytes that malloc would keep; the small images of ordinary traffic leave the RSS flat)."""
        if self._libc is not None and rss_bytes() > self._floor + self.media_growth_bytes:
            self.schedule()

    def after_body(self, size: int, refused: bool = False) -> None:
        """Called on the event loop once a request body of `size` bytes was parsed, or `refused`."""
        if size >= (TRIM_REFUSED_BYTES if refused else TRIM_BODY_BYTES):
            self.schedule()

    def schedule(self) -> None:
        """On the event loop: trim soon (once the request that called it has let go of its memory)."""
        if self._libc is None or self._scheduled:
            return
        self._scheduled = True
        wait = max(self.delay_s, self._last + self.min_interval_s - time.monotonic())
        asyncio.get_running_loop().call_later(wait, self._start)

    async def trim_when_idle(self, admitted: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """For the server's life, on the event loop: once requests were admitted (`admitted` counts them)
        and none has been in flight for `idle_s`, trim once. The CPU engine keeps the memory of its busiest
        step (`cpu_malloc.py`): a burst of long requests would otherwise leave it resident for good; the
        next step after the idle spell faults it in again."""
        trimmed_at = last = admitted()
        quiet_since = time.monotonic()
        while True:
            await asyncio.sleep(self.idle_s / 4)
            count = admitted()
            if in_flight() > 0 or count != last:
                last, quiet_since = count, time.monotonic()
            elif count != trimmed_at and time.monotonic() - quiet_since >= self.idle_s:
                trimmed_at = count
                self.schedule()

    def _start(self) -> None:
        self._scheduled = False
        self._last = time.monotonic()
        try:
            self.pool.submit(self._trim)
        except RuntimeError:  # the pool is shut down: the server is stopping
            pass

    def _trim(self) -> None:
        self._libc.malloc_trim(0)
        self._floor = rss_bytes()
        self.trims += 1
