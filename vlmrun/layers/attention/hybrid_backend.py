"""The backend of hybrid models: full-attention layers to one backend, GDN layers to another.

`Attention` layers call `forward` and go to the full-attention backend (paged KV pool);
`LinearAttention` layers call `forward_linear` and go to the GDN backend (GDN state pool).
Both prepare their per-step metadata once per step: the full backend on `fb.attn_metadata`,
the GDN backend on `fb.extras` (see `gdn_backend.GDN_METADATA_KEY`).
"""

from __future__ import annotations

import torch

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, AttentionBackend, LinearAttention


class HybridAttnBackend(AttentionBackend):
    def __init__(self, full: AttentionBackend, linear: AttentionBackend):
        self.full = full
        self.linear = linear

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.full.init_forward_metadata(fb)
        self.linear.init_forward_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                fb: ForwardBatch) -> torch.Tensor:
        return self.full.forward(q, k, v, layer, fb)

    def forward_linear(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       conv_weight: torch.Tensor, layer: LinearAttention, fb: ForwardBatch) -> torch.Tensor:
        return self.linear.forward_linear(mixed_qkv, g, beta, conv_weight, layer, fb)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.full.init_cuda_graph_state(max_bs)
        self.linear.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        self.full.init_forward_metadata_capture(fb)
        self.linear.init_forward_metadata_capture(fb)

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        self.full.init_forward_metadata_replay(fb)
        self.linear.init_forward_metadata_replay(fb)
