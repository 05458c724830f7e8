"""`SamplingParams.prompt_logprobs` (vLLM's): every prompt token after the first gets its logprob and the
top-k at its position, equal to HF's log-softmax of its logits over the whole prompt (float32, CPU).

Text and an image prompt (image pad positions included), whole prefill and prefill cut into 7-token
chunks, a prompt whose pages are in the prefix cache (such a request takes no hit, as vLLM's), async
scheduling and tensor parallel (TP=2 on the CPU) give the same values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from testing.hf_reference import HFReference
from vlmrun import LLM, SamplingParams

TOPK = 3
ATOL = 1e-4
CASES = {  # architecture -> its chat
    "qwen3": [{"role": "system", "content": "You are brief."},
              {"role": "user", "content": "Tell me about the sea, the sky and the hills."}],
    "qwen2_5_vl": [{"role": "user", "content": [
        {"type": "image", "image": Image.fromarray(np.random.default_rng(1).integers(
            0, 255, size=(90, 120, 3), dtype=np.uint8))},
        {"type": "text", "text": "Describe the image."}]}],
}
_EXPECTED: dict[str, tuple] = {}


def expected_for(request, arch: str) -> tuple:
    """(checkpoint dir, HF prompt ids, HF log-softmax [n, vocab] of the logits at every prompt position)."""
    if arch not in _EXPECTED:
        model_dir = request.getfixturevalue(f"{arch}_dir")
        hf = HFReference(model_dir)
        inputs = hf.inputs(CASES[arch])
        with torch.no_grad():
            logits = hf.model(**inputs).logits[0].float()  # [n, vocab]
        _EXPECTED[arch] = (model_dir, inputs["input_ids"][0].tolist(), torch.log_softmax(logits, dim=-1))
    return _EXPECTED[arch]


def params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOPK, **kwargs)


def assert_matches_hf(out, prompt_ids: list[int], ref: torch.Tensor) -> None:
    assert out.error is None, out.error
    assert out.prompt_token_ids == prompt_ids
    got = out.prompt_logprobs
    assert len(got) == len(prompt_ids) and got[0] is None
    for pos in range(1, len(prompt_ids)):
        row = ref[pos - 1]  # the logits at pos - 1 predict the token at pos
        token = prompt_ids[pos]
        top = torch.topk(row, TOPK).indices.tolist()
        assert set(got[pos]) == set(top) | {token}, pos
        for tok, lp in got[pos].items():
            assert abs(lp - row[tok].item()) < ATOL, (pos, tok, lp, row[tok].item())


@pytest.fixture(params=list(CASES))
def arch(request):
    return request.param


def test_whole_and_chunked_prefill_match_hf(arch, request):
    model_dir, prompt_ids, ref = expected_for(request, arch)
    whole = LLM(str(model_dir), dtype="float32", device="cpu")
    assert_matches_hf(whole.chat(CASES[arch], params(), use_tqdm=False)[0], prompt_ids, ref)
    chunked = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=7, page_size=4)
    assert_matches_hf(chunked.chat(CASES[arch], params(), use_tqdm=False)[0], prompt_ids, ref)


def test_a_cached_prompt_is_computed_again(arch, request):
    model_dir, prompt_ids, ref = expected_for(request, arch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", page_size=4)
    plain = llm.chat(CASES[arch], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    hits = llm.engine.stats().prefix_hit_tokens
    assert_matches_hf(llm.chat(CASES[arch], params(), use_tqdm=False)[0], prompt_ids, ref)
    assert llm.engine.stats().prefix_hit_tokens == hits, "a prompt_logprobs request takes no prefix-cache hit"
    llm.chat(CASES[arch], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens > hits, "the cache still serves the others"


def test_async_scheduling_matches_hf(request):
    model_dir, prompt_ids, ref = expected_for(request, "qwen3")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=7, async_scheduling=True)
    outs = llm.chat([CASES["qwen3"]] * 2, [params(), SamplingParams(temperature=0.0, max_tokens=4)], use_tqdm=False)
    assert_matches_hf(outs[0], prompt_ids, ref)
    assert outs[1].prompt_logprobs is None


def test_tensor_parallel_matches_hf(request):
    model_dir, prompt_ids, ref = expected_for(request, "qwen3")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=7, tensor_parallel_size=2)
    try:
        assert_matches_hf(llm.chat(CASES["qwen3"], params(), use_tqdm=False)[0], prompt_ids, ref)
    finally:
        llm.engine.shutdown()


def test_prompt_logprobs_is_bounded():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
