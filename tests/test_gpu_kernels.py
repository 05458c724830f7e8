"""The CUDA fast path against the torch reference, on a GPU (`@pytest.mark.gpu`, skipped without CUDA).

- FlashInfer's prefill and decode wrappers against the torch attention backend on the same paged
  batches (head_dim 128 and 256, GQA, cached prefixes, a padded decode row), bf16;
- the engine with `gdn_backend="fla"` against `gdn_backend="torch"` (float32: close logprobs,
  equal tokens) on the hybrid models;
- the engine with the whole fast path (FlashInfer + FLA, decode CUDA graphs) against the torch
  backends in bf16 by vLLM's rule, and graphs on against graphs off;
- the fused vision varlen attention against the reference.
Each needs the `gpu` extra (flashinfer-python, flash-linear-attention); missing ones are skipped.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.test_engine_parity import HYBRID, MAX_NEW, TOPK, cases_for
from tests.test_flashinfer_plan import KV_HEADS, make_batch
from tests.test_gpu_engine import cuda_llm, is_vl, max_logprob_gap
from vlmrun import SamplingParams
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

pytestmark = pytest.mark.gpu

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
FAST = {"attention_backend": "flashinfer", "gdn_backend": "fla"}


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)


@needs_flashinfer
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("prefix_lens,extend_lens,padding", [
    ([0, 0], [9, 4], 0), ([8, 0, 13], [7, 5, 1], 0), ([5, 12, 3], [1, 1, 1], 1), ([40, 3], [1, 1], 0)])
def test_flashinfer_equals_torch_backend(head_dim, prefix_lens, extend_lens, padding):
    from vlmrun.layers.attention.flashinfer_backend import FlashInferAttnBackend

    heads = 4 * KV_HEADS  # GQA group of 4: decode on tensor cores
    outs = {}
    for name in ("torch", "flashinfer"):
        pool, rows, fb = make_batch(prefix_lens, extend_lens, padding, device="cuda", dtype=torch.bfloat16,
                                    head_dim=head_dim)
        backend = (TorchAttnBackend(pool, rows) if name == "torch"
                   else FlashInferAttnBackend(pool, rows, heads, head_dim ** -0.5, torch.device("cuda")))
        fb.attn_backend = backend
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(fb.num_tokens, heads * head_dim, generator=gen, device="cuda").bfloat16()
        k = torch.randn(fb.num_tokens, KV_HEADS * head_dim, generator=gen, device="cuda").bfloat16()
        v = torch.randn(fb.num_tokens, KV_HEADS * head_dim, generator=gen, device="cuda").bfloat16()
        backend.prepare(fb)
        outs[name] = backend.forward(q, k, v, Attention(heads, KV_HEADS, head_dim, head_dim ** -0.5, 0), fb)
    real = sum(extend_lens)
    torch.testing.assert_close(outs["flashinfer"][:real].float(), outs["torch"][:real].float(), atol=2e-2, rtol=2e-2)


@needs_fla
@pytest.mark.parametrize("arch", HYBRID)
def test_fla_engine_equals_torch_gdn_in_float32(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    convs = list(cases_for(is_vl(model_dir), True).values())
    want = cuda_llm(model_dir, "float32", gdn_backend="torch").chat(convs, params(), use_tqdm=False)
    for options in ({}, {"max_num_batched_tokens": 7, "page_size": 4}):
        got = cuda_llm(model_dir, "float32", gdn_backend="fla", **options).chat(convs, params(), use_tqdm=False)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.token_ids == w.token_ids, f"{arch} case {i} {options}"
            gap = max_logprob_gap(g.logprobs, w.logprobs)
            print(f"{arch} case {i} {options}: max |logprob gap| FLA vs torch GDN {gap:.2e}")
            assert gap < 1e-3


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("arch", ["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                                  "qwen3_next"])
def test_fast_path_follows_torch_backends_in_bf16(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    convs = list(cases_for(is_vl(model_dir), arch in HYBRID).values())
    want = cuda_llm(model_dir, "bfloat16", attention_backend="torch", gdn_backend="torch").chat(
        convs, params(), use_tqdm=False)
    llm = cuda_llm(model_dir, "bfloat16", **FAST)
    got = llm.chat(convs, params(), use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.error is None and g.prompt_token_ids == w.prompt_token_ids
        ok, what = first_divergence_ok_lists(g, w)
        print(f"{arch} case {i}: fast path vs torch backends (bf16): {what}")
        assert ok, what


def first_divergence_ok_lists(ours, ref) -> tuple[bool, str]:
    """vLLM's rule between two vlmrun outputs (each side's top-k logprob dicts)."""
    for step, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a != b:
            ok = a in ref.logprobs[step] and b in ours.logprobs[step]
            return ok, f"diverged at step {step}: {a} vs {b} (each in the other's top-{TOPK}: {ok})"
    return len(ours.token_ids) == len(ref.token_ids), "identical"


@needs_flashinfer
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
def test_cuda_graphs_equal_eager(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    convs = list(cases_for(is_vl(model_dir), arch in HYBRID).values())
    options = dict(FAST) if importlib.util.find_spec("fla") else {"attention_backend": "flashinfer"}
    graphs = cuda_llm(model_dir, "bfloat16", **options)
    assert graphs.engine.runner.padded_decode.graphs, "decode graphs were captured"
    eager = cuda_llm(model_dir, "bfloat16", enforce_eager=True, **options)
    # one request: bucket 1 is the unpadded batch, so replay and eager run the same kernels
    one_g, one_e = graphs.chat(convs[0], params(), use_tqdm=False)[0], eager.chat(convs[0], params(), use_tqdm=False)[0]
    assert one_g.token_ids == one_e.token_ids and max_logprob_gap(one_g.logprobs, one_e.logprobs) == 0.0
    for g, e in zip(graphs.chat(convs, params(), use_tqdm=False), eager.chat(convs, params(), use_tqdm=False)):
        ok, what = first_divergence_ok_lists(g, e)
        assert ok, what


def test_fused_vision_attention_equals_reference():
    from vlmrun.models.blocks.vision_common import fused_varlen_attention, plan_segments, varlen_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    segments = plan_segments([64, 256, 100], torch.device("cuda"))
    q, k, v = (torch.randn(420, 16, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))
    torch.testing.assert_close(fused_varlen_attention(q, k, v, segments, scale=0.125).float(),
                               varlen_attention(q, k, v, segments, scale=0.125).float(), atol=2e-2, rtol=2e-2)
