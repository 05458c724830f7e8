"""The seam between the attention layers and the step's backend (`vlmrun/layers/attention/base.py`).

`Attention` goes to `fb.attn_backend.forward`, `GDNAttention` (a GDN layer) to the backend's
GDN backend, `fb.attn_backend.gdn`, which only a `HybridAttnBackend` has: a GDN
layer on any other backend, or a layer on a batch without a backend, is a ValueError that says so
(never an AttributeError), and `check_backend_serves` refuses the pairing before anything runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_flashinfer_plan import HEAD_DIM, HEADS, KV_HEADS, make_batch
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, GDNAttention, GDNBackend, check_backend_serves
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

HK, HV, DK, DV, KERNEL = 1, 2, 4, 4, 4


class RecordingGDN(GDNBackend):
    """A GDN backend that returns zeros of the core output's shape and records its calls."""

    def __init__(self):
        self.calls: list[GDNAttention] = []

    def prepare(self, fb: ForwardBatch) -> None:
        pass

    def forward(self, mixed_qkv, g, beta, conv_weight, layer, fb):
        self.calls.append(layer)
        return torch.zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)


def gdn_inputs(num_tokens: int, layer: GDNAttention) -> tuple[torch.Tensor, ...]:
    return (torch.randn(num_tokens, layer.conv_dim), -torch.rand(num_tokens, HV), torch.rand(num_tokens, HV),
            torch.randn(layer.conv_dim, KERNEL))


def attention_inputs(num_tokens: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(num_tokens, HEADS * HEAD_DIM), torch.randn(num_tokens, KV_HEADS * HEAD_DIM),
            torch.randn(num_tokens, KV_HEADS * HEAD_DIM))


def test_a_hybrid_backend_takes_each_layer_to_its_part():
    pool, rows, fb = make_batch([0, 2], [3, 1])
    full, gdn = TorchAttnBackend(pool, rows), RecordingGDN()
    fb.attn_backend = HybridAttnBackend(full, gdn)
    fb.attn_backend.prepare(fb)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gdn_layer = GDNAttention(0, HK, HV, DK, DV, KERNEL)
    q, k, v = attention_inputs(fb.num_tokens)
    torch.testing.assert_close(attn(q, k, v, fb), full.forward(q, k, v, attn, fb))
    assert gdn_layer(*gdn_inputs(fb.num_tokens, gdn_layer), fb).shape == (fb.num_tokens, HV, DV)
    assert gdn.calls == [gdn_layer]


def test_a_gdn_layer_on_a_backend_without_a_gdn_part_is_a_clear_error():
    pool, rows, fb = make_batch([0], [3])
    fb.attn_backend = TorchAttnBackend(pool, rows)
    fb.attn_backend.prepare(fb)
    gdn_layer = GDNAttention(5, HK, HV, DK, DV, KERNEL)
    with pytest.raises(ValueError, match="GDN layer 5 .*TorchAttnBackend.* has no GDN backend"):
        gdn_layer(*gdn_inputs(fb.num_tokens, gdn_layer), fb)


def test_a_batch_without_a_backend_is_a_clear_error():
    _, _, fb = make_batch([0], [3])
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    with pytest.raises(ValueError, match="carries no attention backend"):
        attn(*attention_inputs(fb.num_tokens), fb)


def test_check_backend_serves_refuses_gdn_layers_without_a_linear_backend():
    pool, rows, _ = make_batch([0], [3])
    full = TorchAttnBackend(pool, rows)
    dense = nn.ModuleList([Attention(HEADS, KV_HEADS, HEAD_DIM, 1.0, 0)])
    hybrid = nn.ModuleList([Attention(HEADS, KV_HEADS, HEAD_DIM, 1.0, 0), GDNAttention(0, HK, HV, DK, DV, KERNEL)])
    check_backend_serves(dense, full)
    check_backend_serves(hybrid, HybridAttnBackend(full, RecordingGDN()))
    with pytest.raises(ValueError, match="ModuleList has Gated DeltaNet layers .*TorchAttnBackend"):
        check_backend_serves(hybrid, full)
