"""LoRA under tensor parallelism on the CPU (gloo): TP=2 gives what TP=1 gives, HF + PEFT's tokens.

Each rank keeps its slices of every adapter (B's rows of its output shards for column-parallel
layers, A's columns of its input shard for row-parallel ones, its expert units or, with expert
parallelism, its whole experts): a batch of the base model and three adapters (attention, MLP, GDN
projections, experts, vision tower) must equal HF + PEFT run one request at a time (greedy tokens,
logprobs within 1e-4), the bound tests/test_lora.py holds TP=1 to. A bad adapter fails its request
in the driver, before any rank sees it.
"""

from __future__ import annotations

import pytest

from tests.test_engine_parity import assert_matches
from tests.test_lora import lora_setup, params
from vlmrun import LLM, LoRARequest


@pytest.mark.parametrize("arch, expert_parallel", [("qwen3_5_moe", False), ("qwen3_vl_moe", True)])
def test_tp2_equals_tp1_with_adapters(request, arch, expert_parallel, tmp_path):
    setup = lora_setup(request, arch)
    jobs = [(name, case) for name in ["base", *setup.adapters] for case in setup.cases]
    prompts = [setup.cases[case] for _, case in jobs]
    loras = [None if name == "base" else setup.request(name) for name, _ in jobs]
    options = dict(dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(str(setup.model_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **options)
    try:
        outs = llm.chat(prompts, params(), use_tqdm=False, lora_request=loras)
        bad = llm.chat(prompts[0], params(), use_tqdm=False, lora_request=LoRARequest("gone", 9, str(tmp_path)))[0]
    finally:
        llm.engine.shutdown()
    for (name, case), out in zip(jobs, outs):
        assert_matches(out, setup.expected[(name, case)], f"TP=2 {name}/{case}")
    assert "'gone'" in bad.error and "does not exist" in bad.error
