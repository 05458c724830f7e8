"""LoRA adapters with speculative decoding: each row's drafts are verified through its own adapter.

Rows of the base model and of several adapters (more than the slots: they take turns) decode with
drafts accepted whole, in part and not at all (tests/test_spec_decode.py's `OracleDrafts`, from the
same engine's plain decode): the tokens and logprobs are plain decode's. Eagerly (with async
scheduling too), and padded as on CUDA, where a verify step lays each sequence out in 1 + k rows (the
row's padding runs its adapter); under tensor parallelism (TP=2 against TP=1's plain decode); and with
the MTP layer of a hybrid checkpoint drafting beside the adapted model.
"""

from __future__ import annotations

import pytest

from tests.test_async_scheduling import assert_same
from tests.test_lora import lora_setup
from tests.test_padded_verify import padded_verify_steps  # noqa: F401 (a fixture)
from tests.test_spec_decode import SPEC, OracleDrafts, total
from vlmrun import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def jobs_of(setup) -> tuple[list, list]:
    """Every case with the base model and with each adapter: prompts and their LoRA requests."""
    jobs = [(name, case) for name in ["base", *setup.adapters] for case in setup.cases]
    return ([setup.cases[case] for _, case in jobs],
            [None if name == "base" else setup.request(name) for name, _ in jobs])


@pytest.mark.parametrize("arch, enforce_eager, async_scheduling",
                         [("qwen3_vl", True, False), ("qwen3_5", False, False), ("qwen3_vl_moe", False, False),
                          ("qwen3", True, True)])
def test_adapted_rows_with_drafts_equal_plain_decode(request, arch, enforce_eager, async_scheduling,
                                                     padded_verify_steps):
    setup = lora_setup(request, arch)
    prompts, loras = jobs_of(setup)
    options = dict(dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                   enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    plain = LLM(str(setup.model_dir), **options).chat(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    references = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    assert len({tuple(r) for r in references}) == len(references)  # every adapter answers its own way
    llm = LLM(str(setup.model_dir), **options, speculative_config=SPEC)
    llm.engine.scheduler.proposer = OracleDrafts(references, 3, llm.engine.model_config.text_config.vocab_size)
    spec = llm.chat(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert_same(plain, spec)
    stats = total(spec)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert bool(padded_verify_steps) == (not enforce_eager)


def test_mtp_drafts_beside_an_adapted_model(request, tmp_path):
    """The MTP layer (not adapted: it drafts from the adapted model's hidden states) on a Qwen3.5
    checkpoint with adapters: plain decode's tokens, eager and padded."""
    import shutil

    from testing.tiny_mtp import add_mtp_layer

    setup = lora_setup(request, "qwen3_5")
    model_dir = add_mtp_layer(shutil.copytree(setup.model_dir, tmp_path / "model"))
    prompts, loras = jobs_of(setup)
    for enforce_eager in (True, False):
        options = dict(dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                       enforce_eager=enforce_eager)
        plain = LLM(str(model_dir), **options).chat(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        spec = LLM(str(model_dir), **options, speculative_config={"method": "mtp", "num_speculative_tokens": 2}).chat(
            prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert_same(plain, spec)
        assert total(spec).num_draft_tokens > len(prompts)


def test_tensor_parallel_adapted_rows_with_drafts(request):
    """TP=2 (gloo, one process per rank): each rank verifies the drafts through its slices of the
    adapters; the tokens equal TP=1's plain decode, logprobs within TP's summation noise."""
    setup = lora_setup(request, "qwen3_5_moe")
    prompts, loras = jobs_of(setup)
    options = dict(dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    plain = LLM(str(setup.model_dir), **options).chat(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    references = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    llm = LLM(str(setup.model_dir), tensor_parallel_size=2, speculative_config=SPEC, **options)
    try:
        llm.engine.scheduler.proposer = OracleDrafts(references, 3, llm.engine.model_config.text_config.vocab_size)
        spec = llm.chat(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        llm.engine.shutdown()
    assert_same(plain, spec, logprob_tol=1e-4)
    stats = total(spec)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
