"""glibc's malloc kept from unmapping freed blocks on the CPU engine (vlmrun/executor/cpu_malloc.py).

Each check runs in a fresh interpreter: the setting is process-wide, and this test process has
already built CPU engines (which set it)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrun import LLM
from vlmrun.executor import build

ROOT = Path(__file__).resolve().parents[1]

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

CHURN = """
import json, resource, torch
from vlmrun.executor.cpu_malloc import keep_freed_memory

def faults_of_churn():
    for _ in range(8):  # the heap first grows to hold what the churn leaves free (a few rounds)
        torch.empty(16 << 20).fill_(1.0)
        torch.empty(2 << 20).fill_(1.0)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):  # 64 MiB and 8 MiB blocks allocated, written and freed, as a step's activations are
        torch.empty(16 << 20).fill_(1.0)
        torch.empty(2 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

before = faults_of_churn()
kept = keep_freed_memory()
print(json.dumps({"kept": kept, "before": before, "after": faults_of_churn()}))
"""


def run_churn(**malloc_env: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults, unless given
    out = subprocess.run([sys.executable, "-c", CHURN], cwd=ROOT, env={**env, **malloc_env}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@glibc_only
def test_freed_blocks_are_reused_without_page_faults():
    result = run_churn()
    assert result["kept"]
    assert result["before"] > 10_000, result  # glibc's default: each 64 MiB block mapped and faulted in again
    assert result["after"] < 100, result


@glibc_only
def test_a_users_own_malloc_setting_is_left_alone():
    result = run_churn(MALLOC_TRIM_THRESHOLD_="131072")
    assert not result["kept"]
    assert result["after"] > 10_000, result


@pytest.mark.parametrize("keep", [True, False])
def test_the_cpu_engine_sets_it_unless_told_not_to(qwen3_vl_dir, monkeypatch, keep):
    calls = []
    monkeypatch.setattr(build, "keep_freed_memory", lambda: calls.append(True) or True)
    LLM(str(qwen3_vl_dir), device="cpu", dtype="float32", keep_freed_memory=keep)
    assert calls == ([True] if keep else [])
