"""Keeps glibc's malloc from handing large freed blocks back to the kernel (the CPU engine).

A CPU forward allocates and frees tensors of megabytes (activations, attention's gathered pages,
oneDNN's outputs) every step. glibc serves a block above its mmap threshold (128 KiB at start,
rising with use to at most 32 MiB) with fresh pages from `mmap` and unmaps it on `free`, and it
trims the top of its heap once more than its trim threshold is free there: the next step then
faults the same memory in again, page by page, each page zeroed by the kernel. On the 2-core bench
machine a 32-request float32 image batch of bench/bench_cpu_vs_hf.py took up to ~140,000 minor
page faults this way, and kept from them ran up to ~1.4x faster (bench/bench_cpu_malloc.py;
BENCHMARKS.md has the spread). vLLM's CPU build avoids the same cost by
preloading tcmalloc into its workers.

`keep_freed_memory()` raises both thresholds with `mallopt`, so freed blocks stay in the process
and are reused; the process keeps the memory of its busiest step (as any caching allocator does).
Blocks over `MMAP_THRESHOLD` (a large KV pool) are still mapped and unmapped as they come and go.
It is process-wide and left alone where the user has chosen: the `MALLOC_MMAP_THRESHOLD_` /
`MALLOC_TRIM_THRESHOLD_` variables set, or another allocator in `LD_PRELOAD`. Linux with glibc only.

What it keeps is not only the busiest step's memory, though: over a long run (10,000 images through
`LLM.generate`) the freed blocks of steps of varying shapes, the pixel tensors of the preprocessing
threads (each thread allocates from its own arena) and the long-lived blocks between them (encoder
cache entries, returned outputs) fragment the heaps, and blocks that no later request fits pile up:
the peak RSS grew +382 MB at 1,000 images, +488 MB at 10,000, all but ~50 MB of it free blocks
(`mallinfo2`). `HeapTrimmer` bounds that: called between the input pipeline's steps, it hands every
arena's free pages back (`malloc_trim(0)`) once the RSS has risen `slack_bytes` above the working
set measured after the previous trim, so the steady state costs one trim per `slack_bytes` of
fragmentation (the next step faults its memory in once), not one per step. A no-op (returns False)
where the C library is not glibc (musl, macOS: no `malloc_trim`) or another allocator is preloaded
(it has its own decay).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Any, Optional

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # bytes: larger blocks still come from mmap
TRIM_THRESHOLD = (1 << 31) - 1  # bytes (mallopt takes an int): free heap top kept before trimming
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
TRIM_SLACK_BYTES = 32 << 20  # RSS growth over the working set that trims (HeapTrimmer)


def glibc() -> Optional[Any]:
    """glibc through ctypes; None elsewhere (musl, macOS, Windows) or under another preloaded allocator."""
    if platform.system() != "Linux" or not _libc_version().startswith("glibc"):
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _libc_version() -> str:
    """"glibc 2.39" under glibc, "" elsewhere (confstr is instant; `platform.libc_ver` reads the executable)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return ""


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set."""
    libc = glibc()
    if libc is None or any(name in os.environ for name in USER_SETTINGS):
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    done = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and done
    if done:
        logger.info("glibc malloc keeps freed blocks up to %d MiB for reuse (executor/cpu_malloc.py)",
                    MMAP_THRESHOLD >> 20)
    return done


class HeapTrimmer:
    """Between steps, `malloc_trim(0)` once the RSS is `slack_bytes` above the working set (module docstring).

    The working set is the RSS measured at the first call and at the first call after each trim (the
    step between them faulted back in what it uses), so a steady run trims only as its heaps fragment;
    `trims` counts the calls made. `libc` is glibc's handle (default: this process's, `glibc()`)."""

    def __init__(self, slack_bytes: int = TRIM_SLACK_BYTES, libc: Any = "this process"):
        self.slack_bytes = slack_bytes
        self._libc = glibc() if libc == "this process" else libc
        self.working_set: Optional[int] = None
        self.trims = 0

    def after_step(self) -> bool:
        """Trim if the RSS grew past the working set + slack; True if it did."""
        if self._libc is None:
            return False
        rss = rss_bytes()
        if self.working_set is None:
            self.working_set = rss
            return False
        if rss <= self.working_set + self.slack_bytes:
            return False
        self._libc.malloc_trim(0)
        self.trims += 1
        self.working_set = None  # measured again after the next step
        return True
