"""`cache_salt` (vLLM's prompt field): prefix-cache entries computed under one salt are hit only by prompts of
that salt, never by another salt or by a prompt without one (tiny Qwen3, float32, CPU)."""

from __future__ import annotations

import pytest

from vlmrun import LLM, SamplingParams
from vlmrun.cache.prefix_cache import prompt_page_keys
from vlmrun.engine.prompt_forms import PromptFormError, parse_prompt
from vlmrun.processors import ProcessedPrompt

IDS = [100 + i for i in range(26)]  # 6 full pages of 4 tokens


def hit_tokens(llm: LLM, prompt: dict) -> int:
    """Run `prompt`; the prompt tokens its admission took from the prefix cache."""
    before = llm.engine.prefix_cache_stats().hit_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert out.error is None
    return llm.engine.prefix_cache_stats().hit_tokens - before


def test_a_salt_isolates_its_prefix_cache_entries(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", page_size=4, kv_cache_memory_bytes=8 << 20)
    assert hit_tokens(llm, {"prompt_token_ids": IDS, "cache_salt": "tenant-a"}) == 0
    assert hit_tokens(llm, {"prompt_token_ids": IDS, "cache_salt": "tenant-b"}) == 0, "another salt: no hit"
    assert hit_tokens(llm, {"prompt_token_ids": IDS}) == 0, "no salt: no hit on a salted entry"
    assert hit_tokens(llm, {"prompt_token_ids": IDS, "cache_salt": "tenant-a"}) == 24, "the same salt hits"
    assert hit_tokens(llm, {"prompt_token_ids": IDS, "cache_salt": "tenant-b"}) == 24
    assert hit_tokens(llm, {"prompt_token_ids": IDS}) == 24


def test_the_salt_changes_every_page_key_from_the_first():
    plain = ProcessedPrompt(token_ids=IDS)
    salted = ProcessedPrompt(token_ids=IDS, cache_salt="s")
    a, b = prompt_page_keys(plain, 4), prompt_page_keys(salted, 4)
    assert len(a) == len(b) == 6 and all(x != y for x, y in zip(a, b))
    assert prompt_page_keys(ProcessedPrompt(token_ids=IDS, cache_salt="s"), 4) == b
    assert prompt_page_keys(salted, 4, b"lora:1:x") != b, "an adapter's salt and the prompt's both count"


@pytest.mark.parametrize("salt", ["", 3, ["a"]])
def test_a_bad_salt_is_refused_naming_it(salt):
    with pytest.raises(PromptFormError, match="cache_salt"):
        parse_prompt({"prompt": "hi", "cache_salt": salt})
    assert parse_prompt({"prompt": "hi", "cache_salt": "ok"}).cache_salt == "ok"
