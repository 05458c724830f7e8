"""The decode forward's shortcuts give the same floats as the plain formulas, bit for bit.

- `RMSNorm` (now `rms_norm`, a function the dense attention calls with a weight per head) equals HF's
  Qwen RMSNorm (normalize in float32, cast back, times the weight) over random inputs, shapes and scales.
- `DenseAttention` norms and rotates q and k together (one `rms_norm` with a weight per head, one
  `apply_rotary` over the query and KV heads): the q, k, v it hands to attention equal those of
  norming and rotating each on its own, float32 and bfloat16, with and without q/k norm.
"""

from __future__ import annotations

import types

import pytest
import torch

from vlmrun.layers.norm import RMSNorm
from vlmrun.layers.rotary import MRotaryEmbedding, apply_rotary, prepared_tables
from vlmrun.models.blocks.text_decoder import DenseAttention


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 64), (3, 2048), (7, 5, 128), (1, 4096)])
def test_rms_norm_equals_hf(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    norm = norm.to(dtype)
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, norm.eps))
        strided = torch.cat([x, x], dim=-1)[..., :shape[-1]]  # (as q and k are: views of the qkv output)
        assert torch.equal(norm(strided), hf_rms_norm(strided, norm.weight, norm.eps))


def separate_qkv(attn: DenseAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k, v made head group by head group: q_norm and k_norm, then a rotary each (the formula)."""
    n = x.shape[0]
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = q.view(n, attn.num_heads, attn.head_dim), k.view(n, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q = hf_rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
        k = hf_rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    return apply_rotary(q, cos, sin).reshape(n, -1), apply_rotary(k, cos, sin).reshape(n, -1), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 16, True), (16, 2, 128, True),
                                                             (8, 8, 64, False), (2, 1, 32, True)])
def test_dense_attention_norms_and_rotates_q_and_k_as_one_at_a_time(heads, kv_heads, head_dim, qk_norm, dtype):
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=head_dim, rms_norm_eps=1e-6)
    attn = DenseAttention(config, 0, qkv_bias=not qk_norm, qk_norm=qk_norm, o_bias=False)
    gen = torch.Generator().manual_seed(heads * head_dim)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    attn = attn.to(dtype)
    seen = {}
    attn.attn.forward = lambda q, k, v, fb: seen.update(q=q, k=k, v=v) or q  # what attention gets
    attn.o_proj.forward = lambda out: out
    half = head_dim // 2
    rotary = MRotaryEmbedding(head_dim, 1e6, [half // 4, half // 4, half - half // 2], interleaved=True)
    for n in (1, 9, 256):
        cos, sin = prepared_tables(*rotary(torch.randint(0, 5000, (3, n), generator=gen)))  # as the text model's forward
        x = torch.randn(n, 64, generator=gen).to(dtype)
        with torch.inference_mode():
            attn(x, cos, sin, None)
            q, k, v = separate_qkv(attn, x, cos, sin)
        assert torch.equal(seen["q"], q) and torch.equal(seen["k"], k) and torch.equal(seen["v"], v)
        assert seen["q"].is_contiguous()  # (what a fused kernel may expect of its queries)
    if qk_norm:  # new norm weights (a load) and `after_loading` (as `finish_loading` calls it): the rows made once
        with torch.no_grad():
            attn.q_norm.weight.mul_(2)
            attn.k_norm.weight.add_(1)
        attn.after_loading()
        assert attn.qk_weight is not None
        with torch.inference_mode():
            attn(x, cos, sin, None)
            q, k, _ = separate_qkv(attn, x, cos, sin)
        assert torch.equal(seen["q"], q) and torch.equal(seen["k"], k)


def test_dense_attention_built_and_loaded_under_inference_mode() -> None:
    """Parameters made in inference mode (a user building the model inside `torch.inference_mode()`) carry no
    version counter: the q/k norm rows do not depend on one."""
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   rms_norm_eps=1e-6)
    with torch.inference_mode():
        attn = DenseAttention(config, 0, qkv_bias=False, qk_norm=True, o_bias=False)
        attn.q_norm.weight.mul_(3)
        attn.after_loading()
        rows = attn.qk_norm_weight()
    assert torch.equal(rows[:4], torch.full((4, 16), 3.0)) and torch.equal(rows[4:], torch.ones(2, 16))
