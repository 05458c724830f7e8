"""The two attention-backend interfaces and the `Attention` / `GDNAttention` layers models call.

Model code builds q, k, v and calls `self.attn(q, k, v, fb)` (full attention), or builds the
Gated DeltaNet inputs and calls `self.linear_attn(...)` (linear attention, hybrid models). The
layers hold no weights: they hand the call to the step's backend, `fb.attn_backend`, or for GDN
layers to its GDN backend, `fb.attn_backend.gdn`.

- `AttentionBackend`: full attention over the paged KV pool. `prepare(fb)` builds the step's
  metadata once, before the model runs, onto `fb.attn_metadata`; `forward` writes the layer's
  k/v at `fb.out_cache_loc` and attends over the cache.
- `GDNBackend`: GDN layers over the GDN state pool. `prepare(fb)` builds its metadata
  onto `fb.gdn_metadata`; `forward` runs the causal conv and the gated delta rule from
  each sequence's slot (`fb.state_slots`) and writes the states back. Its decode metadata only
  refers to `fb.state_slots`, so a padded decode batch with static slots is graph-capturable.
  One that `verifies_drafts` (speculative decoding) also keeps, for a sequence with draft tokens
  (`fb.num_drafts_cpu`), the states after each of its positions, and `keep_accepted_states` puts the
  ones after the accepted positions into the slots once the step's tokens are known.
- `HybridAttnBackend` (hybrid_backend.py) composes one of each for hybrid models: it is an
  `AttentionBackend` whose `gdn` is set (None on every other one). A model with GDN layers
  needs one (`check_backend_serves`, run when a runner is built).

The two interfaces implement the protocols `ForwardBatch` is typed with (`AttentionForward`,
`GDNForward` in vlmrun/forward_batch.py, the bottom floor): what the layers call.

Backends are made by `create_attention_backend` (factory.py), keyed by name. The torch backends
are the reference every fast backend is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.forward_batch import AttentionForward, ForwardBatch, GDNForward

HYBRID_HINT = ("a model with GDN layers runs on a HybridAttnBackend (create_attention_backend over caches that "
               "hold a GDN pool)")

class GDNBackend(GDNForward, ABC):
    """Gated DeltaNet layers over the GDN state pool; one implementation per kernel family."""

    verifies_drafts: bool = False  # keeps per-position states of draft-carrying sequences (speculative decoding)

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build the step's metadata once, before the model runs, and store it on `fb.gdn_metadata`."""

    @abstractmethod
    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: "GDNAttention", fb: ForwardBatch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], g [T, Hv] float32, beta [T, Hv], conv_weight [conv_dim, K] -> [T, Hv, Dv].

        Reads and writes the conv and recurrent state of each sequence's slot (`fb.state_slots`).
        """

    def keep_accepted_states(self, metadata: Any, num_accepted: Any) -> None:
        """After a step with drafts (`metadata`: that step's `fb.gdn_metadata`): each draft-carrying
        sequence's slot gets the states after its last known token and its `num_accepted[i]` accepted drafts
        (`num_accepted`: per sequence of the batch, a list or a device tensor the step computed)."""
        raise NotImplementedError(f"{type(self).__name__} does not keep per-position states for drafts")


class AttentionBackend(AttentionForward, ABC):
    """Full (softmax) attention over the paged KV pool; one implementation per kernel family.

    A backend whose decode can be captured in a CUDA graph sets `supports_cuda_graph` and gives
    `graph_metadata(batch_size)` (static buffers for one captured batch size) and
    `prepare_graph(state, fb)` (fill them from a padded decode batch, before capture and before
    each replay, outside the graph).
    """

    supports_cuda_graph: bool = False
    gdn: Optional[GDNBackend] = None  # the GDN layers' backend (HybridAttnBackend only)

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build the step's metadata once, before the model runs, and store it on `fb.attn_metadata`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention", fb: ForwardBatch) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim].

        Writes k, v at `fb.out_cache_loc` of `layer.layer_id`, returns [num_tokens, num_heads * head_dim].
        """

    def graph_metadata(self, batch_size: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")

    def prepare_graph(self, state: Any, fb: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")


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
        return step_backend(fb).forward(q, k, v, self, fb)


class GDNAttention(nn.Module):
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
        gdn = step_backend(fb).gdn
        if gdn is None:
            raise ValueError(f"GDN layer {self.layer_id} runs on a step whose attention backend "
                             f"({type(fb.attn_backend).__name__}) has no GDN backend; {HYBRID_HINT}")
        return gdn.forward(mixed_qkv, g, beta, conv_weight, self, fb)


def step_backend(fb: ForwardBatch) -> AttentionForward:
    """The attention backend `fb` carries; a ValueError when whoever built `fb` set none."""
    if fb.attn_backend is None:
        raise ValueError("the ForwardBatch carries no attention backend: set fb.attn_backend before the model runs")
    return fb.attn_backend


def check_backend_serves(model: nn.Module, backend: AttentionBackend) -> None:
    """A ValueError unless `backend` has a GDN backend for every GDN layer `model` has."""
    if backend.gdn is None and any(isinstance(m, GDNAttention) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has Gated DeltaNet layers and the attention backend "
                         f"{type(backend).__name__} has no GDN backend for them; {HYBRID_HINT}")
