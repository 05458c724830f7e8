"""A request's pixels are dropped once its images are encoded; their embeddings stay pinned in the
encoder cache while the image items live, so preemption by recompute and chunked prefill still find
them, and outputs do not change."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrun import LLM, SamplingParams
from vlmrun.cache.encoder_cache import EncoderCache, ImageEmbedding
from vlmrun.feed.pipeline import PREFILL_STEPS_AHEAD


def image(seed: int, w: int = 64, h: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8))


def chat(*images: Image.Image, text: str = "Describe these.") -> list[dict]:
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def embedding(tokens: int) -> ImageEmbedding:
    return ImageEmbedding(torch.zeros(tokens, 2))


def test_pins_count_toward_the_capacity_and_are_never_evicted():
    cache = EncoderCache(10)
    cache.put("a", embedding(4))
    assert cache.pin("b", embedding(6))
    assert cache.get("a") is not None  # 4 + 6 fits
    cache.put("c", embedding(3))  # 13 > 10: the least recently used evictable entry goes, never the pin
    assert cache.get("a") is None and cache.get("b") is not None and cache.get("c") is not None
    assert not cache.pin("d", embedding(5)), "pins beyond the capacity are refused"
    assert cache.pin("b", embedding(6)) and cache.pinned["b"].holders == 2
    cache.unpin("b")
    assert "b" in cache.pinned
    cache.unpin_later("b")  # the last holder (from any thread): applied at the cache's next call
    assert "b" in cache.pinned
    cache.settle()
    assert cache.num_pinned_tokens == 0 and "b" in cache.entries and cache.get("b") is not None


def test_a_decoding_request_holds_no_pixels(qwen2_5_vl_dir):
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu")
    engine = llm.engine
    prompt = engine.process(chat(image(1), image(2, 90, 30)))
    items = list(prompt.mm_items)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    del prompt
    req = engine.requests["r"]
    while req.num_computed_tokens < req.num_prompt_tokens or not req.output_token_ids:
        engine.step()
    assert all(it.pixel_values is None for it in items), "a request in decode still holds its pixels"
    cache = engine.executor.vision.cache
    assert cache.num_pinned_tokens == sum(it.length for it in items)
    while engine.has_unfinished():
        engine.step()
    del req, items
    gc.collect()
    cache.settle()
    assert cache.num_pinned_tokens == 0 and not cache.pinned, "a finished request's pins are released"


@pytest.mark.parametrize("encoder_cache_tokens", [32768, 1], ids=["pinned", "pins-refused"])
def test_preemption_and_chunks_give_the_same_tokens(qwen2_5_vl_dir, encoder_cache_tokens):
    convs = [chat(image(10 + i, 48 + 8 * i, 40), text=f"Picture {i}: what is in it?") for i in range(5)]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu")
    expected = [o.token_ids for o in roomy.chat(convs, sampling, use_tqdm=False)]
    longest = max(len(roomy.engine.process(c).token_ids) for c in convs) + 12
    tight = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=16,
                max_num_seqs=5, kv_cache_memory_bytes=kv_bytes(roomy, (longest // 4 + 2) * 4),
                encoder_cache_tokens=encoder_cache_tokens)
    got = [o.token_ids for o in tight.chat(convs, sampling, use_tqdm=False)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    gc.collect()
    tight.engine.executor.vision.cache.settle()
    assert tight.engine.executor.vision.cache.num_pinned_tokens == 0


def kv_bytes(llm: LLM, tokens: int) -> int:
    text = llm.engine.model_config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return tokens * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4


def test_generate_holds_the_pixels_of_the_prefetch_and_one_step_not_of_max_num_seqs(qwen2_5_vl_dir, monkeypatch):
    prefetch, budget, n = 2, 24, 24
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu", max_num_seqs=n, max_num_batched_tokens=budget,
              preprocess_workers=1, preprocess_prefetch=prefetch)
    engine = llm.engine
    items: list = []
    seen = {"holding": 0, "in_flight": 0}
    process, step = engine.process, engine.step

    def recording_process(prompt):
        out = process(prompt)
        items.extend(weakref.ref(it) for it in out.mm_items)
        return out

    def watching_step():
        holding = sum(1 for ref in items if ref() is not None and ref().pixel_values is not None)
        seen["holding"] = max(seen["holding"], holding)
        seen["in_flight"] = max(seen["in_flight"], len(engine.requests))
        return step()

    monkeypatch.setattr(engine, "process", recording_process)
    monkeypatch.setattr(engine, "step", watching_step)
    prompts = ({"prompt": f"Picture {i}.", "images": [image(i, 32, 32)]} for i in range(n))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(o.error is None for o in outs)
    tokens = len(process({"prompt": "Picture 0.", "images": [image(0, 32, 32)]}).token_ids)
    window = max(prefetch, -(-PREFILL_STEPS_AHEAD * budget // tokens)) + 1  # inputs with no token yet
    assert seen["holding"] <= prefetch + 1 + window, seen  # + the one a worker is preprocessing
    assert seen["in_flight"] > prefetch + 1 + window, "decoding requests are not held back"
