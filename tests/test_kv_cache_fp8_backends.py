"""The attention backends over a float8 KV pool: the CPU backend equals the torch reference on the same
stored values, both equal attention over the dequantized values (stored x scale), and FlashInfer (GPU,
`@pytest.mark.gpu`) follows the torch backend. Batches: tests/test_flashinfer_plan.py's `make_batch`
(prefills, chunks over a cached prefix, decodes, padding rows; pages scattered)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.test_flashinfer_plan import HEAD_DIM, KV_HEADS, make_batch
from vlmrun.cache.kv_pool import dequantize
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

BATCHES = [([0, 0], [9, 4], 0), ([8, 0, 13], [7, 5, 1], 0), ([5, 12, 3], [1, 1, 1], 1), ([40, 3], [1, 1], 0)]
SCALES = ([0.5], [2.0])


def to_fp8(pool, compute_dtype: torch.dtype) -> None:
    """`pool` (made in `compute_dtype`) stored as float8 e4m3 with SCALES."""
    pool.dtype, pool.compute_dtype = torch.float8_e4m3fn, compute_dtype
    pool.k_buffers = [b.to(pool.dtype) for b in pool.k_buffers]
    pool.v_buffers = [b.to(pool.dtype) for b in pool.v_buffers]
    pool.set_scales(*SCALES)


def run(make_backend, batch, fp8: bool, device: str = "cpu", dtype: torch.dtype = torch.float32,
        head_dim: int = HEAD_DIM, heads: int = 4 * KV_HEADS):
    prefix_lens, extend_lens, padding = batch
    pool, rows, fb = make_batch(prefix_lens, extend_lens, padding, device=device, dtype=dtype, head_dim=head_dim)
    if fp8:
        to_fp8(pool, dtype)
    else:  # the reference: the fp8 pool's values, dequantized, in a `dtype` pool
        plain = make_batch(prefix_lens, extend_lens, padding, device=device, dtype=dtype, head_dim=head_dim)[0]
        to_fp8(plain, dtype)
        pool.k_buffers = [dequantize(b, SCALES[0][0], dtype) for b in plain.k_buffers]
        pool.v_buffers = [dequantize(b, SCALES[1][0], dtype) for b in plain.v_buffers]
    backend = make_backend(pool, rows)
    fb.attn_backend = backend
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(fb.num_tokens, heads * head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(fb.num_tokens, KV_HEADS * head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(fb.num_tokens, KV_HEADS * head_dim, generator=gen, device=device).to(dtype)
    if not fp8:  # what the fp8 pool keeps of this step's k / v
        k = (k.float() / SCALES[0][0]).to(torch.float8_e4m3fn).float().mul(SCALES[0][0]).to(dtype)
        v = (v.float() / SCALES[1][0]).to(torch.float8_e4m3fn).float().mul(SCALES[1][0]).to(dtype)
    backend.prepare(fb)
    out = backend.forward(q, k, v, Attention(heads, KV_HEADS, head_dim, head_dim ** -0.5, 0), fb)
    return out[:sum(extend_lens)]


@pytest.mark.parametrize("batch", BATCHES)
def test_cpu_and_torch_backends_read_the_fp8_pool_as_dequantized_values(batch):
    cpu = run(CpuAttnBackend, batch, fp8=True)
    reference = run(TorchAttnBackend, batch, fp8=True)
    dequantized = run(TorchAttnBackend, batch, fp8=False)
    torch.testing.assert_close(cpu, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference, dequantized, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
@pytest.mark.parametrize("batch", BATCHES)
def test_flashinfer_on_an_fp8_pool_follows_the_torch_backend(batch):
    """Not yet run on a GPU (docs/kv_cache_dtype.md): FlashInfer with kv_data_type float8 and the layer's
    k_scale / v_scale against the torch backend on the same pool, bfloat16 queries."""
    from vlmrun.layers.attention.flashinfer_backend import FlashInferAttnBackend

    head_dim, heads = 128, 4 * KV_HEADS
    outs = {}
    for name in ("torch", "flashinfer"):
        make = (TorchAttnBackend if name == "torch" else
                lambda pool, rows: FlashInferAttnBackend(pool, rows, heads, head_dim ** -0.5, torch.device("cuda")))
        outs[name] = run(make, batch, fp8=True, device="cuda", dtype=torch.bfloat16, head_dim=head_dim, heads=heads)
    torch.testing.assert_close(outs["flashinfer"].float(), outs["torch"].float(), atol=3e-2, rtol=3e-2)
