"""The hybrid decoder of Qwen3-Next and Qwen3.5: Gated DeltaNet (linear attention) and gated full attention.

- `ZeroCenteredRMSNorm`: RMSNorm scaled by (1 + weight), multiply in float32 (weights stored around 0).
- `GatedRMSNorm`: the GDN output norm, weight * rmsnorm(core) * silu(z), per value head.
- `GatedAttention`: q_proj yields the query and an output gate per head; q/k zero-centred norms;
  rotary on the first `rotary_dim` dims of each head only (partial rope); output * sigmoid(gate).
- `GatedDeltaNet`: projections -> `GDNAttention` (causal conv + gated delta rule in the backend)
  -> gated norm -> out_proj. The seam takes q|k|v before the conv, g = -exp(A_log) * softplus(a + dt_bias)
  and beta = sigmoid(b). Its projections are Qwen3-Next's fused ones; Qwen3.5 overrides them.
- `HybridTextModel`: embeddings (+ multimodal splice), decoder layers per `config.layer_types`, final norm.
  Full-attention layers get KV-pool ids 0..n-1 in layer order, GDN layers GDN-pool ids 0..m-1.

Tensor parallelism (`tp`): attention heads split as in the dense decoder (`qkv_parallel_linear`);
a GDN layer's key and value heads split evenly, so each rank holds whole key-head groups with
their value heads: its q | k | v | z projection rows, conv channels (q | k | v, the conv state
pool's channels on this rank), dt_bias, A_log and b | a rows; out_proj sums over the ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention import Attention, GDNAttention
from vlmrun.layers.linear import (ColumnParallelLinear, RowParallelLinear, ShardedRows, VocabParallelEmbedding,
                                  check_shape, copy_rows)
from vlmrun.layers.rotary import apply_rotary, prepared_tables, rope_parameters
from vlmrun.models.blocks.text_decoder import MakeMLP, qkv_parallel_linear, text_head_dim
from vlmrun.parallel import SINGLE, TensorParallel

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ZeroCenteredRMSNorm(nn.Module):
    """rmsnorm(x) * (1 + weight), computed in float32 and cast back (Qwen3-Next / Qwen3.5)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate): normalise in float32, scale in x's dtype, gate in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., hidden_size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head; the rest pass through.

    x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim] (`rotary.prepared_tables`).
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def rotary_dim(config: Any) -> int:
    """head_dim * partial_rotary_factor: how many dims of each head the rotary embedding turns."""
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(text_head_dim(config) * float(factor))


class GatedAttention(nn.Module):
    """Full attention with a per-head sigmoid output gate, q/k zero-centred norms and partial rope."""

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads or total_heads
        self.num_heads = tp.num_heads(total_heads)  # this rank's
        self.num_kv_heads = tp.num_heads(total_kv_heads)
        self.head_dim = text_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q_proj rows per head: query then gate
        self.qkv_proj = qkv_parallel_linear(hidden, total_heads, total_kv_heads, 2 * self.head_dim, self.head_dim,
                                            tp, bias)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, tp, bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [n, heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        out = self.attn(q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v, fb)  # [n, q_size]
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, self.q_size)))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer with Qwen3-Next's fused projections.

    in_proj_qkvz: hidden -> (q | k | v | z) after the loader's reordering; in_proj_ba: hidden -> (b | a).
    Subclasses with other projections override `project`.
    """

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden = config.hidden_size
        total_k_heads, total_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        # this rank's shards: q and k heads, v (and z) heads, one row per value head (b, a, dt_bias, A_log)
        self.k_shard = tp.heads(total_k_heads, self.head_k_dim, "GDN key heads")
        self.v_shard = tp.heads(total_v_heads, self.head_v_dim, "GDN value heads")
        self.head_shard = tp.heads(total_v_heads, 1, "GDN value heads")
        self.num_k_heads = self.k_shard.length // self.head_k_dim
        self.num_v_heads = self.head_shard.length
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = config.linear_conv_kernel_dim
        self._init_projections(hidden)
        # Depthwise causal conv over q|k|v; only its weight [conv_dim, 1, kernel] is used (by the backend).
        self.conv1d = ShardedRows([self.k_shard, self.k_shard, self.v_shard], (1, kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(total_v_heads * self.head_v_dim, hidden, tp)
        self.attn = GDNAttention(layer_id, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                 kernel)

    def _init_projections(self, hidden: int) -> None:
        qkvz = [self.k_shard, self.k_shard, self.v_shard, self.v_shard]
        self.in_proj_qkvz = ColumnParallelLinear(hidden, qkvz)
        self.in_proj_ba = ColumnParallelLinear(hidden, [self.head_shard, self.head_shard])

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        """dt_bias and A_log: this rank's value heads."""
        param = getattr(self, name)
        check_shape(tensor, (self.head_shard.total,), hf_name, name)
        copy_rows(param, tensor, self.head_shard.start, hf_name)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> mixed_qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv]."""
        mixed_qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        return mixed_qkv, z, b, a

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        mixed_qkv, z, b, a = self.project(x)
        beta = torch.sigmoid(b)  # [n, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [n, Hv] float32 log decay
        core = self.attn(mixed_qkv, g, beta, self.conv1d.weight.squeeze(1), fb)  # [n, Hv, Dv]
        out = self.norm(core, z.view(n, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(n, self.value_dim))


def kind_indices(layer_types: list[str]) -> list[int]:
    """Each layer's index among the layers of its own type (its KV-pool or GDN-pool layer_id)."""
    seen: dict[str, int] = {}
    out = []
    for t in layer_types:
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise NotImplementedError(f"layer type {t!r} is not supported")
        out.append(seen.get(t, 0))
        seen[t] = out[-1] + 1
    return out


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention) then MLP (dense or MoE)."""

    def __init__(self, config: Any, layer_type: str, kind_id: int, mlp: nn.Module,
                 gdn_cls: type[GatedDeltaNet], tp: TensorParallel = SINGLE):
        super().__init__()
        self.is_gdn = layer_type == LINEAR_ATTENTION
        if self.is_gdn:
            self.linear_attn = gdn_cls(config, kind_id, tp)
        else:
            self.self_attn = GatedAttention(config, kind_id, tp)
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # h: [num_tokens, hidden]
        x = self.input_layernorm(h)
        h = h + (self.linear_attn(x, fb) if self.is_gdn else self.self_attn(x, cos, sin, fb))
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridTextModel(nn.Module):
    """Embeddings (+ image splice), hybrid decoder layers, final norm -> hidden [num_tokens, hidden]."""

    def __init__(self, config: Any, rotary_emb: nn.Module, make_mlp: MakeMLP,
                 gdn_cls: type[GatedDeltaNet], tp: TensorParallel = SINGLE):
        super().__init__()
        layer_types = list(config.layer_types)[: config.num_hidden_layers]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, t, kind_id, make_mlp(i), gdn_cls, tp)
            for i, (t, kind_id) in enumerate(zip(layer_types, kind_indices(layer_types)))
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if fb.mm_embeds is not None:  # masked_scatter: no device->host sync on the mask
            h = h.masked_scatter(fb.mm_mask[:, None], fb.mm_embeds.to(h.dtype))
        cos, sin = prepared_tables(*self.rotary_emb(positions))  # [num_tokens, 1, rotary_dim] each, every layer
        for layer in self.layers:
            h = layer(h, cos, sin, fb)
        return self.norm(h)
