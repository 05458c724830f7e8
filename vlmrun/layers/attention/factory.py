"""Attention backends by name: the one place a backend is chosen.

`create_attention_backend(setup, attention, gdn)` returns the full-attention backend
over the KV pool, or, when the caches hold a GDN state pool (a hybrid model), a
`HybridAttnBackend` pairing it with a GDN backend. Names: "torch" (the reference, any
device), "cpu" (full attention laid out for the CPU's kernels, the CPU's default; the CPU only), "flashinfer"
(full attention, CUDA) and "fla" (GDN, CUDA); "auto" picks by device from `AUTO`. A fast backend
joins `AUTO` for CUDA only once it has passed the GPU checks of docs/gpu_checks.md; until then
"auto" on CUDA means torch and the CUDA fast path is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vlmrun.cache.plan import Caches
from vlmrun.layers.attention.base import AttentionBackend, GDNBackend
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.attention.paged_decode import load_paged_decode
from vlmrun.layers.attention.torch_backend import TorchAttnBackend


@dataclass(frozen=True)
class BackendSetup:
    """What a backend is built from: the caches and the shape of the model's attention."""

    caches: Caches
    num_q_heads: int  # query heads of the full-attention layers (kernels plan with them)
    scaling: float  # softmax scale of the full-attention layers
    device: torch.device


def _cpu(setup: BackendSetup) -> AttentionBackend:
    if setup.device.type != "cpu":  # (it reads the page table as host memory)
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, not on {setup.device}; "
                         "use 'torch' (or 'flashinfer' on CUDA)")
    return CpuAttnBackend(setup.caches.kv_pool, setup.caches.req_to_token, paged_decode=load_paged_decode())


def _flashinfer(setup: BackendSetup) -> AttentionBackend:
    from vlmrun.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(setup.caches.kv_pool, setup.caches.req_to_token, setup.num_q_heads,
                                 setup.scaling, setup.device)


def _fla(setup: BackendSetup) -> GDNBackend:
    from vlmrun.layers.attention.fla_backend import FLAGDNBackend
    from vlmrun.layers.attention.kernels import import_fla

    import_fla(setup.device)  # a clear error before the kernels are touched
    return FLAGDNBackend(setup.caches.gdn_pool)


ATTENTION_BACKENDS: dict[str, Callable[[BackendSetup], AttentionBackend]] = {
    "torch": lambda setup: TorchAttnBackend(setup.caches.kv_pool, setup.caches.req_to_token),
    "cpu": _cpu,
    "flashinfer": _flashinfer,
}
GDN_BACKENDS: dict[str, Callable[[BackendSetup], GDNBackend]] = {
    "torch": lambda setup: TorchGDNBackend(setup.caches.gdn_pool),
    "fla": _fla,
}
# What "auto" means per option and device type (unverified fast backends stay out).
AUTO: dict[str, dict[str, str]] = {
    "attention_backend": {"cpu": "cpu", "cuda": "torch"},
    "gdn_backend": {"cpu": "torch", "cuda": "torch"},
}


def create_attention_backend(setup: BackendSetup, attention: str = "auto",
                             gdn: str = "auto") -> AttentionBackend:
    full = _lookup(ATTENTION_BACKENDS, attention, "attention_backend", setup.device)(setup)
    if setup.caches.gdn_pool is None:
        return full
    gdn_backend = _lookup(GDN_BACKENDS, gdn, "gdn_backend", setup.device)(setup)
    return HybridAttnBackend(full, gdn_backend)


def backend_names(backend: AttentionBackend) -> str:
    """The kernel families a built backend runs, for logs: e.g. "FlashInferAttnBackend + FLAGDNBackend"."""
    if isinstance(backend, HybridAttnBackend):
        return f"{type(backend.full).__name__} + {type(backend.gdn).__name__}"
    return type(backend).__name__


def resolve_backend_name(name: str, option: str, device: torch.device) -> str:
    """`name`, or what "auto" means for `option` on `device`."""
    return AUTO[option].get(device.type, "torch") if name == "auto" else name


def _lookup(table: dict[str, Callable], name: str, option: str, device: torch.device) -> Callable:
    resolved = resolve_backend_name(name, option, device)
    if resolved not in table:
        raise ValueError(f"unknown {option} {name!r}; choose auto or one of {', '.join(sorted(table))}")
    return table[resolved]
