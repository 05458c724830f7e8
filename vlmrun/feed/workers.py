"""How many preprocessing workers to start (the CPUs this process may really use), and of which kind.

`os.cpu_count()` counts the machine's cores; a process pinned to fewer (`taskset`, a Kubernetes CPU
set) or limited by a cgroup CPU quota (`docker --cpus`, a pod's CPU limit) gets fewer in practice, and
more threads than that only contend. Workers are threads: image decoding (PIL) and the resize /
normalise / patchify of the image processor (torchvision, torch) release the GIL, and threads scaled
with the cores in `bench/bench_preprocess.py --workers` while sharing the processor with no copy
(docs/input_pipeline.md has the figures).

Threads stop scaling once the GIL is the bound: a whole input holds it about a quarter of its time
(`bench/bench_feed_stages.py`), so about 1 / 0.25 = 4 threads keep it busy. `worker_pool` picks:
"thread" / "process" as asked, "auto" processes (`process_workers.py`) only where more than
`THREAD_SCALING_WORKERS` workers run and the call is long enough to pay for starting them (a few
seconds: each imports torch and loads the processor), threads otherwise: on this 2-core machine auto
is always threads, which measured as fast as processes there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

MAX_DEFAULT_WORKERS = 8  # past this, preprocessing outruns any one engine (and the GIL's share grows)
WORKER_POOLS = ("thread", "process", "auto")
THREAD_SCALING_WORKERS = 4  # threads past this wait on the GIL (a whole input holds it ~25 % of its time)
PROCESS_MIN_INPUTS = 256  # inputs of a call that pay for starting worker processes (unknown: a generator, yes)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Optional[float]:
    """CPUs' worth of time the cgroup of this process may use per period (cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None when unlimited or unknown."""
    for folder in _cgroup_folders(root, proc_cgroup):
        quota = _v2_quota(folder / "cpu.max")
        if quota is None:
            quota = _v1_quota(folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us")
        if quota is not None:
            return quota
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on (its affinity mask), capped by the cgroup CPU quota; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def preprocess_workers(limit: int = MAX_DEFAULT_WORKERS) -> int:
    """The default number of preprocessing worker threads: the usable CPUs, at most `limit`."""
    return max(1, min(limit, usable_cpus()))


def check_pool(pool: str) -> str:
    """ValueError unless `pool` is one of WORKER_POOLS."""
    if pool not in WORKER_POOLS:
        raise ValueError(f"preprocess_pool must be one of {', '.join(WORKER_POOLS)}, got {pool!r}")
    return pool


def worker_pool(pool: str, workers: int, inputs: Optional[int], portable: bool, main_guarded: bool = True) -> str:
    """"thread" or "process": what a call with `workers` workers and `inputs` inputs (None: unknown) runs
    for `pool` ("auto": processes past THREAD_SCALING_WORKERS workers, for PROCESS_MIN_INPUTS inputs or
    more, when the main script may be imported by a spawned process, `main_guarded`); threads whenever
    the call's work cannot go to a process (`portable` False)."""
    if check_pool(pool) == "auto":
        long_call = inputs is None or inputs >= PROCESS_MIN_INPUTS
        pool = "process" if workers > THREAD_SCALING_WORKERS and long_call and main_guarded else "thread"
    return pool if portable else "thread"


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's own cgroup folders (v2 `0::/path`, v1 `N:cpu,cpuacct:/path`), then the root's."""
    folders = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            folders.append(root / relative)
        elif "cpu" in controllers.split(","):
            folders += [root / "cpu" / relative, root / "cpu,cpuacct" / relative]
    return folders + [root, root / "cpu", root / "cpu,cpuacct"]


def _v2_quota(path: Path) -> Optional[float]:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(quota_path: Path, period_path: Path) -> Optional[float]:
    try:
        quota, period = int(quota_path.read_text()), int(period_path.read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
