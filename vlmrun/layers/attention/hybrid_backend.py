"""The backend of hybrid models: full-attention layers to one backend, GDN layers to another.

`Attention` layers call `forward` and go to the full-attention backend (paged KV pool);
`GDNAttention` layers call `gdn.forward`: the GDN backend (GDN state pool), the
one `AttentionBackend` whose `gdn` is set. `prepare` prepares both once per step: the full
backend's metadata on `fb.attn_metadata`, the GDN one's on `fb.gdn_metadata`.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, AttentionBackend, GDNBackend


def full_attention(backend: AttentionBackend) -> AttentionBackend:
    """The backend of `backend`'s full-attention layers: itself, or a hybrid backend's `full` (what a
    module with only full-attention layers, such as an MTP layer, prepares and runs on)."""
    return backend.full if isinstance(backend, HybridAttnBackend) else backend


class HybridAttnBackend(AttentionBackend):
    def __init__(self, full: AttentionBackend, gdn: GDNBackend):
        self.full = full
        self.gdn: GDNBackend = gdn
        self.supports_cuda_graph = full.supports_cuda_graph

    def prepare(self, fb: ForwardBatch) -> None:
        self.full.prepare(fb)
        self.gdn.prepare(fb)

    def graph_metadata(self, batch_size: int) -> Any:
        return self.full.graph_metadata(batch_size)

    def prepare_graph(self, state: Any, fb: ForwardBatch) -> None:
        self.full.prepare_graph(state, fb)
        self.gdn.prepare(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                fb: ForwardBatch) -> torch.Tensor:
        return self.full.forward(q, k, v, layer, fb)
