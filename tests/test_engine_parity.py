"""End-to-end parity with HF transformers (float32, CPU): prompt ids, greedy tokens, logprobs.

Every case runs through `vlmrun.LLM` (scheduler, paged KV cache, GDN state pool, vision stage,
sampler) and is compared with HF `generate` run one request at a time. Hybrid (Gated DeltaNet)
architectures add a prompt longer than three 64-token GDN chunks and prefill chunks that end at,
just before and just after the 64-token chunk boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from testing.hf_reference import HFReference
from vlmrun import LLM, SamplingParams

MAX_NEW = 10
TOPK = 5
ATOL = 1e-4
ARCHS = ["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
GDN_CHUNK = 64
LONG_TEXT = " ".join(f"Item {i}: a {c} {o} sits {p}." for i, (c, o, p) in enumerate(
    [("red", "cup", "on the table"), ("blue", "car", "near the door"), ("green", "tree", "in the park"),
     ("small", "dog", "under a chair"), ("old", "clock", "on the wall")] * 2))


def make_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


def user(*items) -> dict:
    content = [{"type": "image", "image": it} if isinstance(it, Image.Image) else {"type": "text", "text": it}
               for it in items]
    return {"role": "user", "content": content}


def cases_for(is_vl: bool, hybrid: bool = False) -> dict[str, list[dict]]:
    text_only = [{"role": "system", "content": "You are brief."}, user("Tell me about the sea and the sky.")]
    if not is_vl:
        cases = {
            "text": text_only,
            "multi_turn": [user("Hello there."), {"role": "assistant", "content": "Hi! How can I help?"},
                           user("Name three colours.")],
        }
    else:
        cases = {
            "text": text_only,
            "one_image": [user(make_image(120, 90, 1), "Describe the image.")],
            "odd_images": [user(make_image(33, 77, 2), make_image(250, 61, 3), make_image(97, 97, 4),
                                "Compare these pictures.")],
            "multi_turn": [user(make_image(64, 48, 5), "What is this?"),
                           {"role": "assistant", "content": "A small picture of noise."},
                           user(make_image(150, 40, 6), "And this one?")],
        }
    if hybrid:  # longer than three GDN chunks; for VL models an image straddles the first chunk boundary
        long_items = ([LONG_TEXT[:110], make_image(130, 100, 7), LONG_TEXT[110:]] if is_vl
                      else ["Read this list. " + LONG_TEXT])
        cases["long"] = [user(*long_items)]
    return cases


_SETUPS: dict[str, tuple] = {}


def setup_for(request, arch: str) -> tuple:
    """(checkpoint dir, cases, HF results), computed once per architecture."""
    if arch not in _SETUPS:
        model_dir = request.getfixturevalue(f"{arch}_dir")
        hf = HFReference(model_dir)
        cases = cases_for(hf.is_vl, arch in HYBRID)
        expected = {name: hf.generate(msgs, MAX_NEW) for name, msgs in cases.items()}
        if "long" in expected:
            assert len(expected["long"].prompt_ids) > 3 * GDN_CHUNK
        _SETUPS[arch] = (model_dir, cases, expected)
    return _SETUPS[arch]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request):
    return setup_for(request, request.param)


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)


def assert_matches(out, exp, label: str) -> None:
    assert out.error is None, f"{label}: {out.error}"
    assert out.prompt_token_ids == exp.prompt_ids, f"{label}: prompt ids differ"
    assert out.token_ids == exp.token_ids, f"{label}: greedy tokens differ"
    assert len(out.logprobs) == len(exp.token_ids)
    for step, (ours, ref) in enumerate(zip(out.logprobs, exp.logprobs)):
        assert out.token_ids[step] in ours
        assert len(ours) in (TOPK, TOPK + 1)
        for tok, lp in ours.items():
            assert abs(lp - ref[tok].item()) < ATOL, f"{label} step {step} token {tok}: {lp} vs {ref[tok].item()}"
        top = set(torch.topk(ref, TOPK).indices.tolist())
        assert top <= set(ours), f"{label} step {step}: top-{TOPK} ids differ"


def run_cases(llm: LLM, cases: dict, expected: dict, repeat: int = 1) -> None:
    names = list(cases) * repeat
    outs = llm.chat([cases[n] for n in names], params(), use_tqdm=False)
    for name, out in zip(names, outs):
        assert_matches(out, expected[name], name)


def test_each_case_alone(arch_setup):
    model_dir, cases, expected = arch_setup
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    for name, msgs in cases.items():
        assert_matches(llm.chat(msgs, params(), use_tqdm=False)[0], expected[name], name)


def test_mixed_batch(arch_setup):
    model_dir, cases, expected = arch_setup
    run_cases(LLM(str(model_dir), dtype="float32", device="cpu"), cases, expected)


def test_chunked_prefill_splits_image_spans(arch_setup):
    model_dir, cases, expected = arch_setup
    # Chunks of 7 tokens cut every image span (each image has >= 4 tokens) at several places.
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=7, page_size=4)
    run_cases(llm, cases, expected)
    if llm.engine.executor.vision is not None:
        cache = llm.engine.executor.vision.cache
        n_images = sum(len(llm.engine.process(c).mm_items) for c in cases.values())
        assert cache.misses == n_images, "each image must be encoded once even when split across chunks"


def test_preemption_by_recompute(arch_setup):
    model_dir, cases, expected = arch_setup
    longest = max(len(e.prompt_ids) + MAX_NEW for e in expected.values())
    page = 4
    pages = (longest + page - 1) // page + 2  # room for the longest request alone, not for all at once
    seqs = 8
    budget = pages * page * llm_kv_bytes_per_token(model_dir) + (seqs + 1) * llm_gdn_bytes_per_request(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", page_size=page, max_num_batched_tokens=16,
              max_num_seqs=seqs, kv_cache_memory_bytes=budget, enforce_eager=False)  # decode padded, as on CUDA
    run_cases(llm, cases, expected, repeat=3)
    assert llm.engine.scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    assert llm.engine.caches.allocator.num_free_pages() == llm.engine.caches.allocator.num_usable_pages()


@pytest.mark.parametrize("arch", HYBRID)
@pytest.mark.parametrize("budget", [GDN_CHUNK - 1, GDN_CHUNK, GDN_CHUNK + 1])
def test_prefill_chunks_around_gdn_chunk_boundaries(request, arch, budget):
    """Prefill chunks ending just before, at and just after the GDN 64-token chunks carry the state right."""
    model_dir, cases, expected = setup_for(request, arch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=budget)
    # alone, the long prompt is cut exactly at multiples of the budget (mixed batches cut it
    # elsewhere: test_mixed_batch, test_chunked_prefill_splits_image_spans)
    assert_matches(llm.chat(cases["long"], params(), use_tqdm=False)[0], expected["long"], f"long@{budget}")
    if llm.engine.executor.vision is not None:  # the long prompt's image straddles a chunk boundary
        item = llm.engine.process(cases["long"]).mm_items[0]
        assert item.offset < GDN_CHUNK < item.offset + item.length


def _text_config(model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    return getattr(cfg, "text_config", None) or cfg


def llm_kv_bytes_per_token(model_dir) -> int:
    """float32 K and V of every full-attention layer (GDN layers keep no KV)."""
    text = _text_config(model_dir)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * layer_types.count("full_attention") * text.num_key_value_heads * head_dim * 4


def llm_gdn_bytes_per_request(model_dir) -> int:
    """float32 conv + recurrent state of every GDN layer for one request (0 without GDN layers)."""
    text = _text_config(model_dir)
    num_linear = (getattr(text, "layer_types", None) or []).count("linear_attention")
    if not num_linear:
        return 0
    hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (text.linear_conv_kernel_dim - 1)
    return num_linear * (conv + hv * dv * dk) * 4
