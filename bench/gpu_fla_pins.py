"""A pytest plugin for the GPU acceptance run (`-p bench.gpu_fla_pins`): with
`VLMRUN_FLA_PINNED_CONFIGS=1`, FLA's autotuners are pinned to one config each before any test runs,
so a test whose first FLA call comes from HF's Qwen3.5 layers (not vlmrun's FLA backend, which pins
by itself) compiles one config per kernel too (vlmrun/layers/attention/fla_backend.py)."""

from __future__ import annotations

import importlib.util
import os


def pytest_configure(config) -> None:
    from vlmrun.layers.attention.fla_backend import PIN_CONFIGS_ENV, pin_fla_configs

    if os.environ.get(PIN_CONFIGS_ENV) == "1" and importlib.util.find_spec("fla") is not None:
        pinned = pin_fla_configs()
        print(f"FLA: {sum(v == 'pinned' for v in pinned.values())} kernels pinned, "
              f"{sum(v != 'pinned' for v in pinned.values())} on their first candidate")
