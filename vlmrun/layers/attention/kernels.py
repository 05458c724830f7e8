"""The optional CUDA kernel libraries, imported only when a backend that needs them is built.

`import_flashinfer(device)` and `import_fla(device)` return the module or raise
`BackendUnavailable` (a ValueError) that names the option, the device it needs and the extra to
install, or the missing module when the package is there but one of its own imports fails (FlashInfer
0.6 imports `requests` at import time, for instance). Nothing of them is imported on the CPU path.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

GPU_EXTRA = "pip install 'vlmrun[gpu]'"


class BackendUnavailable(ValueError):
    """An attention backend was asked for that this machine or device cannot run."""


def import_flashinfer(device: torch.device) -> ModuleType:
    _require_cuda("attention_backend='flashinfer'", device)
    return _import("flashinfer", "attention_backend='flashinfer'", "flashinfer-python")


def import_fla(device: torch.device) -> ModuleType:
    _require_cuda("gdn_backend='fla'", device)
    return _import("fla", "gdn_backend='fla'", "flash-linear-attention")


def _require_cuda(option: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailable(f"{option} runs on CUDA only; this engine runs on {device} "
                                 f"(use 'auto' or 'torch')")


def _import(module: str, option: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or "?"
        if missing.split(".")[0] == module:
            raise BackendUnavailable(f"{option} needs the {package} package, which is not installed: "
                                     f"{GPU_EXTRA}") from exc
        raise BackendUnavailable(f"{option}: {package} is installed but its import needs the module "
                                 f"{missing!r}, which is not ({exc}); {GPU_EXTRA} installs the extra's "
                                 f"dependencies") from exc
