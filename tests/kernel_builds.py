"""The paged decode kernel for the tests that run it: built, or the test skipped with the reason.

Where `VLMRUN_REQUIRE_PAGED_DECODE=1` (CI sets it: its machines have a C compiler) a kernel that cannot be
built fails the test instead, so that the kernel's tests cannot all skip unnoticed.
"""

from __future__ import annotations

import os

import pytest

from vlmrun.layers.attention.paged_decode import PagedDecodeKernel, load_paged_decode


def require_paged_decode() -> PagedDecodeKernel:
    kernel = load_paged_decode()
    if kernel is None:
        reason = "the paged decode kernel could not be built here (no C compiler with OpenMP, or not Linux)"
        if os.environ.get("VLMRUN_REQUIRE_PAGED_DECODE") == "1":
            pytest.fail(reason + ", and VLMRUN_REQUIRE_PAGED_DECODE=1 requires it")
        pytest.skip(reason)
    return kernel
