"""The flash-linear-attention GDN backend on the CPU, through Triton's interpreter, against the torch
GDN reference: mixed extend/decode steps, FLA's own kernels (varlen conv and chunked delta rule for
extends, conv update and fused recurrent delta rule for decodes), state gather and write-back by
slot, a padding row on the dummy slot (tests/fla_interpret_check.py, in a process of its own because
the interpreter must be on before triton is imported). Skipped when fla or triton is not installed
(the `gpu` extra)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_fla_and_triton = pytest.mark.skipif(not (_installed("fla-core") and _installed("triton")),
                                          reason="flash-linear-attention / triton not installed")
pytestmark = needs_fla_and_triton


def run_interpreter_check(module: str) -> str:
    """`python -m module` in a process of its own (the Triton interpreter is chosen before triton is
    imported): its stdout; the test fails with the end of its output when it fails."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_fla_backend_equals_the_torch_reference_under_the_triton_interpreter():
    assert "outputs max|fla - torch|" in run_interpreter_check("tests.fla_interpret_check")
