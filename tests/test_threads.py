"""The CPU engine's thread count: the cores the process may really use (affinity, cgroup quota), sized to
the model, overridden by `--threads` / `num_threads` / VLMRUN_NUM_THREADS, an OMP_NUM_THREADS left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrun.threads import PARAMS_PER_THREAD, CpuBudget, cgroup_cpu_quota, choose_threads

ROOT = Path(__file__).resolve().parents[1]
BIG = 100 * PARAMS_PER_THREAD  # a model with work for many threads
TINY = 3_000_000  # the bundled shapes model


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_of_the_process_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    _write(tmp_path / "proc", "0::/a/b\n")
    _write(tmp_path / "fs/a/cpu.max", "300000 100000\n")
    _write(tmp_path / "fs/a/b/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 3.0
    _write(tmp_path / "fs/a/b/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 1.5


def test_cgroup_v2_inside_a_container_namespace_reads_the_root(tmp_path: Path) -> None:
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "fs/cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 2.0


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    _write(tmp_path / "proc", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 2.5
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") is None


def test_budget_rounds_the_quota_down_and_keeps_one_core() -> None:
    assert CpuBudget(affinity=8, quota=2.5).cores == 2
    assert CpuBudget(affinity=2, quota=None).cores == 2
    assert CpuBudget(affinity=8, quota=0.5).cores == 1
    assert CpuBudget(affinity=1, quota=4.0).cores == 1


def test_the_choice_follows_the_budget_and_the_model_size() -> None:
    wide = CpuBudget(affinity=16, quota=None)
    assert choose_threads(None, TINY, current=16, environ={}, budget=wide).threads == 1
    assert choose_threads(None, BIG, current=16, environ={}, budget=wide).threads == 16
    assert choose_threads(None, BIG, current=16, environ={}, budget=CpuBudget(16, quota=4.0)).threads == 4
    assert choose_threads(None, BIG, current=16, ranks=4, environ={}, budget=wide).threads == 4
    assert choose_threads(None, 3 * PARAMS_PER_THREAD, current=16, environ={}, budget=wide).threads == 3


def test_overrides_win_in_order() -> None:
    wide = CpuBudget(affinity=16, quota=None)
    env = {"VLMRUN_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert choose_threads(2, TINY, current=16, environ=env, budget=wide).threads == 2  # --threads / num_threads
    assert choose_threads(None, TINY, current=16, environ=env, budget=wide).threads == 3  # VLMRUN_NUM_THREADS
    omp = choose_threads(None, TINY, current=16, environ={"OMP_NUM_THREADS": "5"}, budget=wide)
    assert omp.threads is None and "OMP_NUM_THREADS" in omp.reason  # the user's pool: left alone
    lowered = choose_threads(None, BIG, current=2, environ={}, budget=wide)  # torch.set_num_threads(2) before
    assert lowered.threads == 2
    with pytest.raises(ValueError, match="VLMRUN_NUM_THREADS"):
        choose_threads(None, TINY, current=16, environ={"VLMRUN_NUM_THREADS": "lots"}, budget=wide)


def test_num_threads_is_checked_by_the_engine_config() -> None:
    from vlmrun.config import EngineConfig

    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_the_threads_flag_reaches_the_engine_config() -> None:
    from vlmrun.cli import build_parser
    from vlmrun.server.cli import engine_config

    args = build_parser().parse_args(["serve", "--threads", "3"])
    assert engine_config(args).num_threads == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--threads", "0"])


_ENGINE_THREADS = """
import sys, torch
from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine
torch.set_num_threads(2)
Engine(EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 24, **eval(sys.argv[1])))
print(torch.get_num_threads())
"""


@pytest.mark.parametrize("options, env, expected", [
    ({}, {}, 1),  # the bundled 3 M model: one thread, whatever the cores
    ({"num_threads": 2}, {}, 2),
    ({}, {"VLMRUN_NUM_THREADS": "2"}, 2),
])
def test_the_engine_applies_the_choice_once_built(options: dict, env: dict, expected: int) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                                 "VLMRUN_NUM_THREADS")}
    environ.update(env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _ENGINE_THREADS, repr(options)], env=environ, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == str(expected)
