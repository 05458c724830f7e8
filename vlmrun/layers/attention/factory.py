"""Attention backends by name: the one place a backend is chosen.

`create_attention_backend(caches, attention="torch", linear_attention="torch")` returns the
full-attention backend over the KV pool, or, when the caches hold a GDN state pool (a hybrid
model), a `HybridAttnBackend` pairing it with a linear-attention backend. A new kernel family
adds one entry to a table here (the CUDA fast path adds "flashinfer" and "fla").
"""

from __future__ import annotations

from typing import Callable

from vlmrun.cache.plan import Caches
from vlmrun.layers.attention.base import AttentionBackend, LinearAttentionBackend
from vlmrun.layers.attention.gdn_backend import TorchGDNBackend
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

ATTENTION_BACKENDS: dict[str, Callable[[Caches], AttentionBackend]] = {
    "torch": lambda caches: TorchAttnBackend(caches.kv_pool, caches.req_to_token),
}
LINEAR_ATTENTION_BACKENDS: dict[str, Callable[[Caches], LinearAttentionBackend]] = {
    "torch": lambda caches: TorchGDNBackend(caches.gdn_pool),
}


def create_attention_backend(caches: Caches, attention: str = "torch",
                             linear_attention: str = "torch") -> AttentionBackend:
    full = _lookup(ATTENTION_BACKENDS, attention, "attention_backend")(caches)
    if caches.gdn_pool is None:
        return full
    return HybridAttnBackend(full, _lookup(LINEAR_ATTENTION_BACKENDS, linear_attention, "gdn_backend")(caches))


def _lookup(table: dict[str, Callable], name: str, option: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {option} {name!r}; choose one of {', '.join(sorted(table))}")
    return table[name]
