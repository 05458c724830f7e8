"""The dense Qwen text stack (every layer full attention) of Qwen3, Qwen2.5-VL and Qwen3-VL: `DenseTextModel`.

embed -> (multimodal splice) -> decoder layers (with DeepStack adds after the first layers when
the batch's multimodal extras carry them, `DEEPSTACK`) -> final norm. It knows nothing of batching: attention goes through
`Attention(q, k, v, forward_batch)`. Qwen3 uses per-head q/k RMSNorm and no qkv bias; Qwen2-style
text (Qwen2.5-VL) uses qkv bias and no q/k norm. Each layer's MLP is the model's (`make_mlp`): the
dense SwiGLU, or a sparse MoE block in Qwen3-VL-MoE. (The hybrid stack is `hybrid_decoder.py`.)

Parameter names mirror the HF text model (`embed_tokens`, `layers.{i}.self_attn.o_proj`, ...), so
loading a checkpoint is a prefix mapping; q/k/v load into the fused `qkv_proj` and gate/up into
`gate_up_proj` (`vlmrun.layers.linear`). Under tensor parallelism (`tp`) each rank holds its
attention heads (KV heads replicated when there are fewer than ranks) and MLP units.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention import Attention
from vlmrun.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from vlmrun.layers.norm import RMSNorm, rms_norm
from vlmrun.layers.rotary import apply_rotary, prepared_tables
from vlmrun.parallel import SINGLE, TensorParallel

# The name of Qwen3-VL's DeepStack features among a batch's multimodal extras (`ForwardBatch.mm_extras`,
# `Model.mm_extras`): [k, num_mm_tokens, hidden], added to the image rows after each of the first k layers.
DEEPSTACK = "deepstack"


def text_head_dim(config: Any) -> int:
    """head_dim from the config, or hidden_size // num_attention_heads when absent."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qkv_parallel_linear(hidden: int, num_heads: int, num_kv_heads: int, q_head_rows: int, head_dim: int,
                        tp: TensorParallel, bias: bool) -> ColumnParallelLinear:
    """q_proj | k_proj | v_proj fused, each part split by heads (`q_head_rows` rows per query head)."""
    shards = [tp.heads(num_heads, q_head_rows, "attention heads"),
              tp.heads(num_kv_heads, head_dim, "KV heads", replicate=True),
              tp.heads(num_kv_heads, head_dim, "KV heads", replicate=True)]
    return ColumnParallelLinear(hidden, shards, bias, part_names=("q_proj", "k_proj", "v_proj"))


class DenseAttention(nn.Module):
    """Full attention with fused qkv, optional per-head q/k RMSNorm, rotary (1-D or M-RoPE cos/sin)."""

    def __init__(self, config: Any, layer_id: int, *, qkv_bias: bool, qk_norm: bool, o_bias: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.num_heads = tp.num_heads(total_heads)  # this rank's
        self.num_kv_heads = tp.num_heads(config.num_key_value_heads or total_heads)
        self.head_dim = text_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_parallel_linear(hidden, total_heads, config.num_key_value_heads or total_heads,
                                            self.head_dim, self.head_dim, tp, qkv_bias)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, tp, o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer_id)
        self.register_buffer("qk_weight", None, persistent=False)  # `qk_norm_weight`'s rows once loaded

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        # q and k side by side, normed and rotated together (per head: the same floats as one at a time, in
        # half the ops): [num_tokens, num_heads + num_kv_heads, head_dim] (this rank's heads)
        qk = qkv[:, :self.q_size + self.kv_size].view(n, heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = rms_norm(qk, self.qk_norm_weight(), self.q_norm.eps)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, :heads].reshape(n, self.q_size).contiguous()  # [num_tokens, q_size]
        k = qk[:, heads:].reshape(n, self.kv_size)  # [num_tokens, kv_size] (a view)
        out = self.attn(q, k, qkv[:, self.q_size + self.kv_size:], fb)  # [num_tokens, q_size]
        return self.o_proj(out)

    def qk_norm_weight(self) -> torch.Tensor:
        """[num_heads + num_kv_heads, head_dim]: q_norm's weight on each query head, k_norm's on each KV head
        (made once by `after_loading`; a module used before that, as some tests do, makes it per call).
        Both norms take `config.rms_norm_eps` (built so above), so one eps serves the q and k heads."""
        if self.qk_weight is not None:
            return self.qk_weight
        return torch.cat((self.q_norm.weight.expand(self.num_heads, -1), self.k_norm.weight.expand(self.num_kv_heads, -1)))

    def after_loading(self) -> None:
        """The weights are final (`models.weights.finish_loading`): `qk_norm_weight`'s rows made once, a buffer
        (it moves with the module). Weights written later need this called again, as the linears' packing does."""
        if self.qk_norm:
            self.qk_weight = None
            self.qk_weight = self.qk_norm_weight().detach().clone()


MakeMLP = Callable[[int], nn.Module]  # layer index -> that layer's MLP (dense or MoE): `Model.make_mlp`


class DenseDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, mlp: nn.Module, *, qkv_bias: bool, qk_norm: bool, o_bias: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = DenseAttention(config, layer_id, qkv_bias=qkv_bias, qk_norm=qk_norm, o_bias=o_bias, tp=tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # h: [num_tokens, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, fb)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseTextModel(nn.Module):
    """Embeddings, decoder layers and final norm. Returns hidden states [num_tokens, hidden].

    Qwen3 / Qwen3-VL text: qkv_bias = o_bias = config.attention_bias (False in released models), qk_norm.
    Qwen2-style text (Qwen2.5-VL): qkv_bias=True, qk_norm=False, o_bias=False.
    """

    def __init__(self, config: Any, rotary_emb: nn.Module, make_mlp: MakeMLP, *, qkv_bias: bool = False,
                 qk_norm: bool = True, o_bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DenseDecoderLayer(config, i, make_mlp(i), qkv_bias=qkv_bias, qk_norm=qk_norm, o_bias=o_bias, tp=tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # masked_scatter rather than boolean indexing: no device->host sync on the mask
        rows = None if fb.mm_mask is None else fb.mm_mask[:, None]  # [num_tokens, 1] bool
        if fb.mm_embeds is not None:
            h = h.masked_scatter(rows, fb.mm_embeds.to(h.dtype))
        cos, sin = prepared_tables(*self.rotary_emb(positions))  # [num_tokens, 1, head_dim] each, for every layer
        deepstack = fb.mm_extras.get(DEEPSTACK) if fb.mm_extras else None  # [k, num_mm_tokens, hidden] | None
        num_deepstack = 0 if deepstack is None else deepstack.shape[0]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, fb)
            if i < num_deepstack:  # DeepStack: add visual features to the image rows after layer i
                h = h + torch.zeros_like(h).masked_scatter(rows, deepstack[i].to(h.dtype))
        return self.norm(h)
