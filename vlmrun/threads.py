"""How many threads the CPU engine runs its steps on: what the process may really use, sized to the model.

torch sizes its thread pool from the cores it sees, not from the CPU quota of a container (the cgroup's
`cpu.max`, or `cpu.cfs_quota_us` / `cpu.cfs_period_us` under cgroup v1) nor from what else runs on the
machine; its OpenMP threads spin-wait on each other at every parallel region, so a thread that has
no core (throttled by the quota, or preempted by other work) stalls the others. A small model has
little to split: its GEMMs are a few rows by a few hundred columns, and a second thread costs a
fork/join per operator for next to nothing (BENCHMARKS.md, "Threads on the CPU").

`choose_threads` decides once, where the engine builds its CPU runner (`executor/build.py`), in this
order:
1. `EngineConfig.num_threads` (`--threads`, `LLM(num_threads=)`), else `VLMRUN_NUM_THREADS`: exactly that;
2. `OMP_NUM_THREADS` or `MKL_NUM_THREADS` set: torch's own pool, left alone;
3. otherwise the cores the process may use (affinity, then the cgroup quota, divided among
   tensor-parallel ranks), at most one thread per `PARAMS_PER_THREAD` parameters of the model; a
   lower count set earlier with `torch.set_num_threads` is kept.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

ENV_VAR = "VLMRUN_NUM_THREADS"
USER_POOL_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user sized torch's pool: leave it
# Parameters one more thread needs before it pays: below this a model runs on one thread. On a 2-core AMD
# EPYC shared with other work the bundled 3 M-parameter model captioned its sample images ~10x faster on
# one thread than on torch's default two (BENCHMARKS.md, "Threads on the CPU"). The step of 50 M is a
# judgement, not a measured crossover: a model that size has GEMMs of a few thousand columns, where a
# second thread's fork/join is small against the work; re-measure on a quiet machine.
PARAMS_PER_THREAD = 50_000_000
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may run on (`affinity`) and its cgroup CPU quota in cores (None: no quota)."""

    affinity: int
    quota: Optional[float] = None

    @property
    def cores(self) -> int:
        """Whole cores the process can keep busy: the affinity, capped by the quota (rounded down, at least 1)."""
        cores = self.affinity
        if self.quota is not None:
            cores = min(cores, math.floor(self.quota))
        return max(1, cores)

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g} cores"
        return f"{self.affinity} CPUs in this process's affinity, {quota}"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count decided (`threads`; None: torch's pool left as it is) and why, for the log."""

    threads: Optional[int]
    reason: str


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (os.sched_getaffinity where the OS has it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Optional[float]:
    """The CPU quota, in cores, of this process's cgroup and its ancestors (the tightest); None if none.

    cgroup v2: `cpu.max` ("QUOTA PERIOD", or "max PERIOD"); v1: `cpu.cfs_quota_us` (-1: none) over
    `cpu.cfs_period_us`, in the `cpu` controller's hierarchy."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            quotas += [q for d in _dirs_up(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                if mount.is_dir():
                    quotas += [q for d in _dirs_up(mount, path) if (q := _v1_quota(d)) is not None]
                    break
    if not lines:  # no /proc/self/cgroup: the namespace's root only
        quotas += [q for q in (_v2_quota(root), _v1_quota(root / "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _dirs_up(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of `path` under `mount` and each of its ancestors up to `mount` (the ones that
    exist; inside a container's cgroup namespace the path may not, and `mount` is the container's own)."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quota(directory: Path) -> Optional[float]:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or float(period) <= 0:
        return None
    return float(quota) / float(period)


def _v1_quota(directory: Path) -> Optional[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cpu_budget(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CpuBudget:
    return CpuBudget(affinity=affinity_cpus(), quota=cgroup_cpu_quota(root, proc_cgroup))


def threads_for_model(num_params: int, cores: int) -> int:
    """One thread per `PARAMS_PER_THREAD` parameters (at least one), at most `cores`."""
    return max(1, min(cores, num_params // PARAMS_PER_THREAD))


def parse_threads(value: object, source: str) -> int:
    """A thread count from an option or the environment (ValueError naming `source` when it is not >= 1)."""
    try:
        threads = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{source} must be a whole number of threads >= 1, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"{source} must be a whole number of threads >= 1, got {value!r}")
    return threads


def choose_threads(requested: Optional[int], num_params: int, current: int, ranks: int = 1,
                   environ: Optional[Mapping[str, str]] = None, budget: Optional[CpuBudget] = None) -> ThreadChoice:
    """The thread count for a CPU engine running a model of `num_params` parameters on one of `ranks`
    ranks, torch's pool being `current` threads now (module docstring: the order of the rules)."""
    env = os.environ if environ is None else environ
    if requested is not None:
        return ThreadChoice(parse_threads(requested, "num_threads"), "asked for (--threads / num_threads)")
    if env.get(ENV_VAR, "").strip():
        return ThreadChoice(parse_threads(env[ENV_VAR], ENV_VAR), f"{ENV_VAR}={env[ENV_VAR].strip()}")
    for name in USER_POOL_VARS:
        if env.get(name, "").strip():
            return ThreadChoice(None, f"{name}={env[name].strip()} sizes torch's pool")
    budget = budget or cpu_budget()
    cores = max(1, budget.cores // max(1, ranks))
    threads = threads_for_model(num_params, cores)
    reason = (f"{budget.describe()}; {num_params / 1e6:.0f} M parameters"
              + (f", {ranks} ranks" if ranks > 1 else ""))
    if current < threads:
        return ThreadChoice(current, f"{reason}; torch.set_num_threads({current}) set before is kept")
    return ThreadChoice(threads, reason)


def apply_cpu_threads(requested: Optional[int], model: object, ranks: int = 1) -> ThreadChoice:
    """Choose the CPU engine's thread count for `model` (an nn.Module) and set it in torch, once, where the
    runner is built: the threads started after (the engine's) take it from torch."""
    import torch

    num_params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    choice = choose_threads(requested, num_params, torch.get_num_threads(), ranks)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    logger.info("CPU threads: %s (%s)", torch.get_num_threads(), choice.reason)
    return choice
