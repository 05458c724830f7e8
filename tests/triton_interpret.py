"""Runs flash-linear-attention's Triton kernels on the CPU under Triton's interpreter (tests only).

Import this module before anything imports triton or fla, in a process of its own: it sets
`TRITON_INTERPRET=1` and patches two things the interpreter cannot do with FLA 0.6 / Triton 3.9:
  - the autotuner benchmarks its configs through a GPU driver: here it takes the first config;
  - `chunk_delta_h`'s kernels call `.to()` on their `range` loop index, which the interpreter
    yields as a Python int: there `range` yields Triton scalars.
"""

from __future__ import annotations

import builtins
import os

os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402

_run = autotuner.Autotuner.run


def _first_config_run(self, *args, **kwargs):
    self.configs = self.configs[:1]
    return _run(self, *args, **kwargs)


def _kernel_range(*args):
    for i in builtins.range(*(int(a) for a in args)):
        yield tl.full((), i, tl.int32)


autotuner.Autotuner.run = _first_config_run

import fla.ops.common.chunk_delta_h as chunk_delta_h  # noqa: E402

chunk_delta_h.range = _kernel_range
