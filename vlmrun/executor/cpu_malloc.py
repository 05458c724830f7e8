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
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # bytes: larger blocks still come from mmap
TRIM_THRESHOLD = (1 << 31) - 1  # bytes (mallopt takes an int): free heap top kept before trimming
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    done = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and done
    if done:
        logger.info("glibc malloc keeps freed blocks up to %d MiB for reuse (executor/cpu_malloc.py)",
                    MMAP_THRESHOLD >> 20)
    return done
