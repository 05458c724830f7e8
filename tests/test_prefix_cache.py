"""Prefix caching: keys, refcounted pages, and HF parity when prefixes hit (float32, CPU).

Every end-to-end case checks greedy tokens and logprobs against HF (helpers of
tests/test_engine_parity.py) and asserts the hit counts it expects, so the tests fail if caching
silently does nothing. Hybrid cases (Qwen3.5) check that a hit ends only at a GDN snapshot.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from testing.hf_reference import HFReference
from tests.test_engine_parity import LONG_TEXT, assert_matches, make_image, params, user
from vlmrun import LLM
from vlmrun.cache.kv_pool import PageAllocator, token_slots
from vlmrun.cache.prefix_cache import PrefixCache, page_keys

_HF: dict[str, HFReference] = {}


def hf_for(model_dir) -> HFReference:
    key = str(model_dir)
    if key not in _HF:
        _HF[key] = HFReference(model_dir)
    return _HF[key]


def llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", **kw)


def chat_one(engine_llm: LLM, msgs: list[dict]):
    return engine_llm.chat(msgs, params(), use_tqdm=False)[0]


def stats(engine_llm: LLM):
    return engine_llm.engine.prefix_cache_stats()


def assert_no_page_leak(engine_llm: LLM) -> None:
    alloc = engine_llm.engine.caches.allocator
    assert alloc.num_free_pages() == alloc.num_usable_pages()
    assert all(r == 0 for r in alloc.refcount), "a page is still referenced"
    assert alloc.num_evictable_pages() == len(alloc.cached)


# ---------------------------------------------------------------------------- units


def item(h: str, offset: int, length: int):
    return SimpleNamespace(hash=h, offset=offset, length=length, grid_thw=(1, 2, length // 2))


def test_page_keys_chain_and_include_images():
    ids = list(range(40))
    a = page_keys(ids, [item("A", 10, 8)], 8, 5)
    b = page_keys(ids, [item("B", 10, 8)], 8, 5)
    assert a[0] == b[0], "the page before the image is shared"
    assert all(x != y for x, y in zip(a[1:], b[1:])), "every page from the image on differs (chained)"
    assert page_keys(ids, [item("A", 10, 8)], 8, 5) == a
    c = page_keys(ids[:16] + [99] + ids[17:], [item("A", 10, 8)], 8, 5)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:]))


def test_allocator_refcounts_and_lru_eviction():
    alloc = PageAllocator(5, 4)  # 4 usable pages
    cache = PrefixCache(alloc)
    pages = alloc.alloc(3)
    for j, p in enumerate(pages):
        cache.insert(bytes([j]), p)
    m = cache.match([bytes([0]), bytes([1])], 2)  # a second holder of two pages
    assert m.pages == pages[:2]
    alloc.free(pages)
    assert alloc.num_evictable_pages() == 1 and alloc.num_free_pages() == 2
    alloc.free(m.pages)
    assert alloc.num_evictable_pages() == 3 and alloc.num_free_pages() == 4
    got = alloc.alloc(3)  # one free page, then the oldest evictable: the deepest page first
    assert got is not None and cache.stats.evicted_pages == 2
    assert cache.match([bytes([0]), bytes([1]), bytes([2])], 3).pages == [pages[0]]
    assert alloc.alloc(2) is None


def test_token_slots_follow_the_pages():
    """Slot of position p = its page's first slot + p % page_size, for any span of positions."""
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        pages = rng.sample(range(1, 200), 12)
        for _ in range(50):
            start = rng.randrange(12 * page_size)
            end = rng.randrange(start + 1, 12 * page_size + 1)
            want = [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
            assert token_slots(pages, start, end, page_size) == want, (page_size, start, end)


def test_snapshot_memory_is_counted_in_the_one_budget():
    import torch

    from vlmrun.config import CacheShape
    from vlmrun.cache.plan import plan_cache_memory

    shape = CacheShape(num_attention_layers=1, num_kv_heads=2, head_dim=8, num_gdn_layers=2, gdn_conv_dim=64,
                       gdn_conv_kernel=4, gdn_num_v_heads=4, gdn_head_v_dim=8, gdn_head_k_dim=8)
    kw = dict(dtype=torch.float32, gdn_state_dtype=torch.float32, max_num_seqs=4, page_size=4,
              max_model_len_fixed=False)
    base = plan_cache_memory(shape, 1 << 20, max_model_len=4096, **kw)
    assert base.num_gdn_snapshots == 0
    explicit = plan_cache_memory(shape, 1 << 20, max_model_len=4096, gdn_snapshots=10, **kw)
    assert explicit.num_gdn_snapshots == 10
    assert explicit.kv_bytes + explicit.gdn_bytes + explicit.gdn_snapshot_bytes <= (1 << 20) + 4 * 4 * 64
    assert explicit.num_pages < base.num_pages
    tight = plan_cache_memory(shape, 1 << 20, max_model_len=4096, gdn_snapshots=None, **kw)
    assert tight.num_gdn_snapshots == 0 and tight.num_pages == base.num_pages, "auto takes no KV memory"
    roomy = plan_cache_memory(shape, 1 << 20, max_model_len=64, gdn_snapshots=None, **kw)
    assert roomy.num_gdn_snapshots == 4 and roomy.num_pages == 64 * 4 // 4 + 1


# ---------------------------------------------------------------------------- VL parity


def test_multi_turn_reuses_turn_one(qwen3_vl_dir):
    hf = hf_for(qwen3_vl_dir)
    turn1 = [user(make_image(64, 48, 5), "What is this?")]
    on = llm(qwen3_vl_dir, page_size=8)
    out1 = chat_one(on, turn1)
    assert_matches(out1, hf.generate(turn1, 10), "turn1")
    reply = on.tokenizer.decode(out1.token_ids, skip_special_tokens=True)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, user(make_image(80, 40, 6), "And this one?")]
    exp2 = hf.generate(turn2, 10)
    out2 = chat_one(on, turn2)
    assert_matches(out2, exp2, "turn2")
    n1 = len(out1.prompt_token_ids)
    s = stats(on)
    assert s.queries == 2 and s.hits == 1
    assert s.hit_tokens == n1 // 8 * 8, "turn 2 reuses every full page of turn 1's prompt"
    assert s.images_skipped == 1, "turn 1's image lies wholly inside the hit"
    off = llm(qwen3_vl_dir, page_size=8, enable_prefix_caching=False)
    assert chat_one(off, turn1).token_ids == out1.token_ids
    assert chat_one(off, turn2).token_ids == out2.token_ids
    assert off.engine.prefix_cache is None and stats(off).queries == 0
    assert_no_page_leak(on)


def test_different_image_misses_where_the_image_starts(qwen3_vl_dir):
    hf = hf_for(qwen3_vl_dir)
    text = "Please describe the picture below in a few words, carefully and briefly."
    a = [user(text, make_image(64, 64, 11))]
    b = [user(text, make_image(64, 64, 12))]
    e = llm(qwen3_vl_dir, page_size=4)
    assert_matches(chat_one(e, a), hf.generate(a, 10), "a")
    out_b = chat_one(e, b)
    assert_matches(out_b, hf.generate(b, 10), "b")
    offset = e.engine.process(b).mm_items[0].offset
    assert stats(e).hit_tokens == offset // 4 * 4 > 0, "the hit stops at the page where the images differ"
    assert stats(e).images_skipped == 0
    assert_no_page_leak(e)


def test_same_image_twice_skips_the_encoder(qwen3_vl_dir):
    hf = hf_for(qwen3_vl_dir)
    msgs = [user(make_image(96, 64, 21), "What colours do you see here? Answer in one long sentence please.")]
    exp = hf.generate(msgs, 10)
    e = llm(qwen3_vl_dir, page_size=4)
    assert_matches(chat_one(e, msgs), exp, "first")
    vision = e.engine.executor.vision
    misses, hits = vision.cache.misses, vision.cache.hits
    out = chat_one(e, msgs)
    assert_matches(out, exp, "second")
    n = len(exp.prompt_ids)
    assert stats(e).hit_tokens == (n - 1) // 4 * 4
    assert stats(e).images_skipped == 1
    assert (vision.cache.misses, vision.cache.hits) == (misses, hits), "the cached image was not looked up again"
    assert_no_page_leak(e)


def test_hit_ending_inside_an_image_span(qwen3_vl_dir):
    hf = hf_for(qwen3_vl_dir)
    image = make_image(256, 192, 31)  # 48 image tokens, the prompt ends 15 tokens after them
    a = [user(image, "Hi.")]
    b = [user(image, "Now tell me a story about it, with many details.")]
    ids_a = hf.inputs(a)["input_ids"][0].tolist()
    pad = hf.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    it = SimpleNamespace(offset=ids_a.index(pad), length=ids_a.count(pad))
    n_a = len(ids_a)
    page = next((p for p in range(16, 65) if it.offset < n_a // p * p < it.offset + it.length), None)
    assert page is not None, "no page size puts prompt a's last full page inside its image"
    e = llm(qwen3_vl_dir, page_size=page)
    assert_matches(chat_one(e, a), hf.generate(a, 10), "a")
    out = chat_one(e, b)
    assert_matches(out, hf.generate(b, 10), "b")
    hit = stats(e).hit_tokens
    assert hit == n_a // page * page and it.offset < hit < it.offset + it.length
    assert stats(e).images_skipped == 0
    assert_no_page_leak(e)


# ---------------------------------------------------------------------------- hybrid


def test_hybrid_hits_only_at_snapshot_boundaries(qwen3_5_dir):
    hf = hf_for(qwen3_5_dir)
    page = 8
    a = [user("Read this list. " + LONG_TEXT[:200])]
    b = [user("Read this list. " + LONG_TEXT[:150] + " And then something else entirely.")]
    ids_a, ids_b = (hf.inputs(m)["input_ids"][0].tolist() for m in (a, b))
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    full = common // page * page  # b's cached run ends here; snapshots sit only at interval multiples
    interval = next(i for i in (16, 24, 32, 40, 48) if 0 < full // i * i < full)
    expected = full // interval * interval
    e = llm(qwen3_5_dir, page_size=page, max_num_batched_tokens=24, prefix_snapshot_interval=interval)
    assert e.engine.caches.gdn_snapshots is not None
    exp_a = hf.generate(a, 10)
    assert_matches(chat_one(e, a), exp_a, "a")
    out_b = chat_one(e, b)
    assert_matches(out_b, hf.generate(b, 10), "b")
    assert stats(e).hit_tokens == expected, "the hit is cut back to the last snapshot, not the last cached page"
    # the same prompt again hits at a's last full page (a snapshot point the scheduler cut a chunk at)
    assert_matches(chat_one(e, a), exp_a, "a again")
    assert stats(e).hit_tokens == expected + (len(ids_a) - 1) // page * page
    assert_no_page_leak(e)


def test_hybrid_without_snapshots_never_hits(qwen3_5_dir):
    a = [user("Read this list. " + LONG_TEXT[:200])]
    e = llm(qwen3_5_dir, gdn_prefix_snapshots=0, max_num_seqs=2)
    assert e.engine.prefix_cache is None
    first, second = chat_one(e, a), chat_one(e, a)
    assert first.token_ids == second.token_ids and stats(e).hit_tokens == 0


# ---------------------------------------------------------------------------- stress


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
def test_stress_cache_on_matches_off(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    rng = random.Random(7)
    prefixes = ["You are a careful assistant. " * 3, "Answer in French. ", "Count the objects. " * 4]
    images = [make_image(64, 48, 41), make_image(48, 80, 42)] if arch == "qwen3_vl" else [None]
    convs = []
    for i in range(12):
        pre, img = rng.choice(prefixes), rng.choice(images)
        tail = rng.choice(["What now?", "Why?", "Go on please.", "Tell me more about it."])
        content = [pre] + ([img] if img is not None else []) + [tail]
        convs.append([user(*content)])
    kw = dict(page_size=4, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory_bytes=None)
    off = llm(model_dir, enable_prefix_caching=False, **{k: v for k, v in kw.items() if v is not None})
    ref = off.chat(convs, params(), use_tqdm=False)
    # a pool of 60 pages: the cache must evict, and with 4 running requests preemption happens too
    per_page = off.engine.caches.plan.kv_bytes_per_token * 4
    gdn = off.engine.caches.plan.gdn_bytes_per_request
    budget = 60 * per_page + (4 + 1 + 8) * gdn
    on = llm(model_dir, gdn_prefix_snapshots=8 if gdn else None, kv_cache_memory_bytes=budget,
             prefix_snapshot_interval=8, **{k: v for k, v in kw.items() if v is not None})
    outs = on.chat(convs, params(), use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.error is None and o.token_ids == r.token_ids, f"request {i}"
        for step, (x, y) in enumerate(zip(o.logprobs, r.logprobs)):
            for tok, lp in x.items():
                assert abs(lp - y[tok]) < 1e-4, f"request {i} step {step}"
    s = stats(on)
    assert s.hits > 0 and 0 < s.hit_rate < 1
    assert s.evicted_pages > 0, "the small pool should have forced evictions"
    assert on.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    assert_no_page_leak(on)
    assert on.engine.caches.req_to_token.num_free() == on.engine.caches.req_to_token.max_reqs
