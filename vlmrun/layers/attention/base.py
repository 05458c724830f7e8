"""The attention-backend interface and the `Attention` layer that model code calls.

Model code builds q, k, v and calls `self.attn(q, k, v, forward_batch)`; the backend behind
`forward_batch.attn_backend` writes k/v into the KV pool and computes attention over the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One implementation per kernel family. The torch backend is the reference."""

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Prepare per-step metadata once, before the model runs, and store it on `fb.attn_metadata`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention", fb: ForwardBatch) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim].

        Writes k, v at `fb.out_cache_loc` of `layer.layer_id`, returns [num_tokens, num_heads * head_dim].
        """

    def forward_linear(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       conv_weight: torch.Tensor, layer: "LinearAttention", fb: ForwardBatch) -> torch.Tensor:
        """Gated DeltaNet core for hybrid models (see `LinearAttention`); full-attention-only backends lack it."""
        raise NotImplementedError(f"{type(self).__name__} has no linear-attention (GDN) support")

    # CUDA-graph hooks; backends that do not support graphs keep these defaults.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class Attention(nn.Module):
    """Full (softmax) attention over the paged KV cache. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id  # index into the KV pool (full-attention layers only)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, self, fb)


class LinearAttention(nn.Module):
    """Gated DeltaNet core over the GDN state pool. Holds no weights.

    The model's GDN layer computes its projections and calls this with
    mixed_qkv [num_tokens, conv_dim] (q | k | v before the causal conv, conv_dim = 2*Hk*Dk + Hv*Dv),
    g [num_tokens, Hv] float32 (log decay), beta [num_tokens, Hv], and the depthwise conv weight
    [conv_dim, kernel]. The backend runs the causal conv1d (with the slot's carried conv state, SiLU),
    splits q/k/v, L2-normalises q and k, runs the gated delta rule from the slot's recurrent state,
    writes both states back, and returns the core output [num_tokens, Hv, Dv].
    """

    def __init__(self, layer_id: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int):
        super().__init__()
        self.layer_id = layer_id  # index into the GDN state pool (GDN layers only)
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward_linear(mixed_qkv, g, beta, conv_weight, self, fb)
