"""How many preprocessing workers to start: the CPUs this process may really use.

`os.cpu_count()` counts the machine's cores; a process pinned to fewer (`taskset`, a Kubernetes CPU
set) or limited by a cgroup CPU quota (`docker --cpus`, a pod's CPU limit) gets fewer in practice, and
more threads than that only contend. Workers are threads: image decoding (PIL) and the resize /
normalise / patchify of the image processor (torchvision, torch) release the GIL, and threads scaled
with the cores in `bench/bench_preprocess.py --workers` while sharing the processor with no copy
(docs/input_pipeline.md has the figures).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

MAX_DEFAULT_WORKERS = 8  # past this, preprocessing outruns any one engine (and the GIL's share grows)
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
