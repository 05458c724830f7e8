"""FLA's pinned configs (`vlmrun.layers.attention.fla_backend.pin_fla_configs`) take effect: under
Triton's interpreter, with `VLMRUN_FLA_PINNED_CONFIGS=1`, every autotuned FLA kernel of the GDN
backend's forward path runs on exactly its one pinned config and the backend still matches the torch
reference; bad pins are refused (tests/fla_pin_check.py, in a process of its own). Without the pins,
the first GPU call spent its minutes compiling ~92 autotune candidates per GDN shape."""

from __future__ import annotations

from tests.test_fla_backend import needs_fla_and_triton, run_interpreter_check

pytestmark = needs_fla_and_triton


def test_every_autotuned_fla_kernel_runs_on_its_one_pinned_config():
    out = run_interpreter_check("tests.fla_pin_check")
    assert "8 autotuned kernels ran, each on one config" in out, out
    assert ("fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64: ran with [1] config(s) "
            "(its pin)") in out
