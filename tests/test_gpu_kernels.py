"""The CUDA fast path against the torch reference, on a GPU (`@pytest.mark.gpu`, skipped without CUDA).

- FlashInfer's prefill and decode wrappers against the torch attention backend on the same paged
  batches (head_dim 128 and 256, GQA, cached prefixes, a padded decode row), bf16;
- the engine with `gdn_backend="fla"` against `gdn_backend="torch"` on the hybrid models, float32
  (FLA's chunk kernels take their dot products in TF32: a logprob budget of `GDN_FP32_TF32_BUDGET`);
- the engine with the whole fast path (FlashInfer + FLA, decode CUDA graphs) against the torch
  backends and against HF in bf16 by vLLM's rule, and graphs on against graphs off;
- the fused vision varlen attention against the reference.
The engine tests run on the real-shape checkpoints (tests/real_shapes.py: head_dim 128 and 256, the
published GDN heads): FlashInfer refuses the tiny models' head dims (16, 32), as its kernels do.
Each needs the `gpu` extra (flashinfer-python, flash-linear-attention); missing ones are skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.bf16_rule import check_bf16_follows_hf
from tests.real_shapes import FAMILY, LARGE_REAL_SHAPES, REAL_SHAPES, build_real_shape_checkpoint
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
HYBRID_SHAPES = [name for name, family in FAMILY.items() if family in HYBRID and name in REAL_SHAPES]
# float32 FLA against float32 torch GDN: FLA's chunk kernels multiply float32 in TF32 (10-bit mantissa,
# ~5e-4 relative per product), which moves logprobs by ~1e-3 to 1e-2; a kernel fault moves them by far more
GDN_FP32_TF32_BUDGET = 5e-2


@pytest.fixture(scope="module")
def real_shape_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> the real-shape checkpoint of that name, built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_real_shape_checkpoint(name, tmp_path_factory.mktemp(f"real_{name}"))
        return built[name]
    return get


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)


def real_cases(model_dir: Path, name: str) -> list:
    return list(cases_for(is_vl(model_dir), FAMILY[name] in HYBRID).values())


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


@needs_flashinfer
def test_flashinfer_refuses_what_it_cannot_run(qwen3_dir):
    """The tiny models' head dims and float32, refused by name before any kernel is compiled."""
    from vlmrun.layers.attention.kernels import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="head_dim"):
        cuda_llm(qwen3_dir, "bfloat16", attention_backend="flashinfer")
    with pytest.raises(BackendUnavailable, match="float16 and bfloat16 only"):
        cuda_llm(qwen3_dir, "float32", attention_backend="flashinfer")


@needs_fla
@pytest.mark.parametrize("name", HYBRID_SHAPES)
def test_fla_engine_equals_torch_gdn_in_float32(real_shape_dir, name):
    model_dir = real_shape_dir(name)
    convs = real_cases(model_dir, name)
    want = cuda_llm(model_dir, "float32", gdn_backend="torch").chat(convs, params(), use_tqdm=False)
    for options in ({}, {"max_num_batched_tokens": 7, "page_size": 4}):
        got = cuda_llm(model_dir, "float32", gdn_backend="fla", **options).chat(convs, params(), use_tqdm=False)
        assert_follows_within_tf32_budget(got, want, f"{name} {options}: FLA vs torch GDN")


def assert_follows_within_tf32_budget(got: list, want: list, label: str) -> None:
    """Each output of `got` follows `want`'s by vLLM's rule, its logprobs (up to the first differing
    token) within the float32-with-TF32 budget of FLA's chunk kernels."""
    for i, (g, w) in enumerate(zip(got, want)):
        ok, what = first_divergence_ok_lists(g, w)
        gap = max_logprob_gap(g.logprobs[:agreed_steps(g, w)], w.logprobs)
        print(f"{label}, case {i}: {what}; max |logprob gap| {gap:.2e}")
        assert ok, f"{label}, case {i}: {what}"
        assert gap < GDN_FP32_TF32_BUDGET, f"{label}, case {i}: logprobs differ by {gap}"


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_fast_path_follows_torch_backends_in_bf16(real_shape_dir, name):
    model_dir = real_shape_dir(name)
    convs = real_cases(model_dir, name)
    want = cuda_llm(model_dir, "bfloat16", attention_backend="torch", gdn_backend="torch").chat(
        convs, params(), use_tqdm=False)
    got = cuda_llm(model_dir, "bfloat16", **FAST).chat(convs, params(), use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.error is None and g.prompt_token_ids == w.prompt_token_ids
        ok, what = first_divergence_ok_lists(g, w)
        print(f"{name} case {i}: fast path vs torch backends (bf16): {what}")
        assert ok, what


@needs_flashinfer
@needs_fla
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_fast_path_follows_hf_in_bf16(real_shape_dir, name):
    """vLLM's rule and the bf16 error budget against HF bf16 on CUDA (tests/bf16_rule.py)."""
    model_dir = real_shape_dir(name)
    check_bf16_follows_hf(model_dir, FAMILY[name], lambda: cuda_llm(model_dir, "bfloat16", **FAST), "cuda",
                          label=f"fast path, {name}")


def first_divergence_ok_lists(ours, ref) -> tuple[bool, str]:
    """vLLM's rule between two vlmrun outputs (each side's top-k logprob dicts)."""
    for step, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a != b:
            ok = a in ref.logprobs[step] and b in ours.logprobs[step]
            return ok, f"diverged at step {step}: {a} vs {b} (each in the other's top-{TOPK}: {ok})"
    return len(ours.token_ids) == len(ref.token_ids), "identical"


def agreed_steps(ours, ref) -> int:
    """The steps up to and including the first differing token: past it the two histories differ."""
    same = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)) if a != b), None)
    return len(ours.token_ids) if same is None else same + 1


@needs_flashinfer
@pytest.mark.parametrize("name", ["qwen3_vl_2b", *LARGE_REAL_SHAPES])  # dense: MoE routing syncs, no graphs
def test_cuda_graphs_equal_eager(real_shape_dir, name):
    """Graph replay against eager decode. Graph mode plans FlashInfer's split-kv decode kernels for
    every batch (their partial results merge in another order than the eager plan's), so the two
    agree by vLLM's rule, not bit for bit; the gap is printed."""
    model_dir = real_shape_dir(name)
    convs = real_cases(model_dir, name)
    options = dict(FAST) if importlib.util.find_spec("fla") else {"attention_backend": "flashinfer"}
    graphs = cuda_llm(model_dir, "bfloat16", **options)
    assert graphs.engine.executor.bucketed_steps.graphs, "decode graphs were captured"
    eager = cuda_llm(model_dir, "bfloat16", enforce_eager=True, **options)
    one_g, one_e = graphs.chat(convs[0], params(), use_tqdm=False)[0], eager.chat(convs[0], params(), use_tqdm=False)[0]
    batched = zip(graphs.chat(convs, params(), use_tqdm=False), eager.chat(convs, params(), use_tqdm=False))
    for label, (g, e) in [("batch 1", (one_g, one_e)), *((f"batched case {i}", pair) for i, pair in enumerate(batched))]:
        ok, what = first_divergence_ok_lists(g, e)
        gap = max_logprob_gap(g.logprobs[:agreed_steps(g, e)], e.logprobs)
        print(f"{name} {label}: graphs vs eager: {what}; max |logprob gap| {gap:.2e}")
        assert ok, f"{name} {label}: {what}"


@needs_flashinfer
def test_verify_cuda_graphs_equal_padded_eager_verify(real_shape_dir):
    """Speculative decoding (n-gram drafts on repeating prompts) with verify steps replayed from CUDA
    graphs (`verify_cuda_graphs=True`: FlashInfer plans a verify step as one decode row per position)
    against the same steps run padded but eagerly: vLLM's rule, as graphs against eager decode."""
    model_dir = real_shape_dir("qwen3_vl_2b")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = ["one two three four one two three four one two three four one two three",
               "red green blue red green blue red green blue red", "Describe the sea."]
    options = {"attention_backend": "flashinfer", "speculative_config": spec}
    graphs = cuda_llm(model_dir, "bfloat16", verify_cuda_graphs=True, **options)
    runner = graphs.engine.executor.bucketed_steps
    assert runner.verify_graphs and runner.graphs, "verify and decode graphs were captured"
    eager = cuda_llm(model_dir, "bfloat16", **options)
    assert not eager.engine.executor.bucketed_steps.verify_graphs
    sampling = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=TOPK)
    ours = graphs.generate(prompts, sampling, use_tqdm=False)
    for i, (g, e) in enumerate(zip(ours, eager.generate(prompts, sampling, use_tqdm=False))):
        ok, what = first_divergence_ok_lists(g, e)
        print(f"verify graphs vs padded eager, prompt {i}: {what}; drafts {g.metrics.spec_decode}")
        assert ok, f"prompt {i}: {what}"
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in ours) > 0


def test_fused_vision_attention_equals_reference():
    from vlmrun.models.blocks.vision_common import fused_varlen_attention, plan_segments, varlen_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    segments = plan_segments([64, 256, 100], torch.device("cuda"))
    q, k, v = (torch.randn(420, 16, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))
    torch.testing.assert_close(fused_varlen_attention(q, k, v, segments, scale=0.125).float(),
                               varlen_attention(q, k, v, segments, scale=0.125).float(), atol=2e-2, rtol=2e-2)
