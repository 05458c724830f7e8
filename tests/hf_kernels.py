"""HF's hybrid models on a machine with CUDA and flash-linear-attention: CPU tensors to HF's torch path.

transformers binds its GDN functions (`torch_chunk_gated_delta_rule`, ...) to FLA's kernels when
`fla` imports, whatever the tensors' device. On a GPU machine the float32 HF reference still runs
on the CPU, so each bound function is wrapped to call HF's own torch function for CPU tensors.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

import torch

HYBRID_MODULES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")


def route_hf_gdn_kernels_by_device() -> None:
    for name in HYBRID_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn_name in GDN_FUNCTIONS:
            fn = getattr(module, fn_name, None)
            if fn is not None and inspect.unwrap(fn) is not fn:
                setattr(module, fn_name, _by_device(fn, inspect.unwrap(fn)))


def _by_device(kernel: Callable, reference: Callable) -> Callable:
    @functools.wraps(reference)
    def call(*args, **kwargs):
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return (kernel if first.is_cuda else reference)(*args, **kwargs)
    return call
