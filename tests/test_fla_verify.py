"""Speculative decoding on the flash-linear-attention GDN backend (`gdn_backend="fla"`).

A step with draft tokens runs on the `TorchGDNBackend` the FLA backend holds (FLA's kernels return only
a sequence's final state); every other step on FLA's kernels, over the same GDN pool.
- On the CPU, through Triton's interpreter (tests/fla_verify_check.py, a process of its own): FLA
  prefill and decode steps around a verify step (drafts of several lengths, a plain decode and a
  prefill chunk beside them) and `keep_accepted_states` give plain decode's outputs and slot states;
  the verify step equals the torch reference's bit for bit.
- On a GPU (`@pytest.mark.gpu`, a real-shape hybrid checkpoint, float32, n-gram drafts): greedy tokens
  with speculation on FLA equal FLA's own without it; against speculation on the torch GDN backend
  (prompts chunked so prefill chunks share steps with verify passes) they follow vLLM's rule within
  the TF32 logprob budget of tests/test_gpu_kernels.py (FLA's chunk kernels multiply in TF32).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.test_fla_backend import needs_fla_and_triton, run_interpreter_check

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["one two three four one two three four one two three four one two three",
           "red green blue red green blue red green blue red", "Describe the sea."]


@needs_fla_and_triton
def test_fla_backend_verifies_on_the_reference_under_the_triton_interpreter():
    assert "reference verify, FLA decode vs plain decode" in run_interpreter_check("tests.fla_verify_check")


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
def test_speculation_on_fla_equals_plain_fla_and_follows_torch_gdn(tmp_path):
    from tests.real_shapes import build_real_shape_checkpoint
    from tests.test_engine_parity import TOPK
    from tests.test_gpu_engine import cuda_llm
    from tests.test_gpu_kernels import assert_follows_within_tf32_budget
    from vlmrun import SamplingParams

    model_dir = build_real_shape_checkpoint("qwen3_5_35b_a3b", tmp_path / "model")
    sampling = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=TOPK)

    def run(**options):
        return cuda_llm(model_dir, "float32", **options).generate(PROMPTS, sampling, use_tqdm=False)

    spec = run(gdn_backend="fla", speculative_config=SPEC)
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in spec) > 0, "no step verified drafts"
    for i, (s, p) in enumerate(zip(spec, run(gdn_backend="fla"))):
        print(f"prompt {i}: speculation on FLA {s.metrics.spec_decode}")
        assert s.token_ids == p.token_ids, f"prompt {i}: speculation on FLA changed the greedy tokens"

    chunked = {"max_num_batched_tokens": 7, "page_size": 4, "speculative_config": SPEC}
    got, want = run(gdn_backend="fla", **chunked), run(gdn_backend="torch", **chunked)
    assert_follows_within_tf32_budget(got, want, "chunked: speculation on FLA vs on torch GDN")
