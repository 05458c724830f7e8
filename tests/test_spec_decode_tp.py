"""Speculative decoding under tensor parallelism (one process per rank on the CPU, gloo): a TP=2 engine
with drafts gives the tokens of a TP=1 engine without.

Each rank verifies the drafts itself (its KV and GDN shards); rank 0's sampled ids are broadcast in a
step with drafts so that every rank accepts the same drafts (GDN slots, seeded generators, the MTP
layer). The hybrid Qwen3.5 model runs a batch with repeating prompts (n-gram drafts, then drafts from a
reference run, accepted and rejected), chunked prefill, greedy, seeded and structured-output rows; with
its MTP layer, each rank runs its shard of the layer and drafts with it.
"""

from __future__ import annotations

import torch

from tests.test_async_scheduling import assert_same
from tests.test_spec_decode import SPEC, OracleDrafts
from tests.test_spec_decode_mtp import MTP
from tests.test_spec_decode_structured import TAGS, qwen3_5_mtp_dir  # noqa: F401 (a fixture)
from tests.test_tensor_parallel import engine_options
from vlmrun import LLM, SamplingParams
from vlmrun.structured import StructuredOutputsParams

PROMPTS = ["one two three four one two three four one two three four one two three",
           "red green blue red green blue red green blue red",
           "abc abc abc abc abc abc abc abc",
           "red blue red blue red blue red blue"]


def params_list() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=3, ignore_eos=True, logprobs=1),
            SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(
                regex="(abc ){2,5}")),
            SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(json=TAGS))]


def test_tp2_with_drafts_equals_tp1_without(qwen3_5_dir):
    """n-gram drafts (the tiny hybrid model never repeats itself: they are rejected), then drafts from
    the reference run, accepted whole, in part and not at all, structured rows included."""
    model_dir, params = qwen3_5_dir, params_list()
    reference = LLM(str(model_dir), **engine_options(model_dir, 1))
    plain = reference.generate(PROMPTS, params, use_tqdm=False)
    reference.engine.shutdown()
    parallel = LLM(str(model_dir), **engine_options(model_dir, 2), speculative_config=SPEC)
    try:
        assert_same(plain, parallel.generate(PROMPTS, params, use_tqdm=False))
        references = [out.prompt_token_ids + out.token_ids for out in plain]
        vocab_size = parallel.engine.model_config.text_config.vocab_size
        parallel.engine.scheduler.proposer = OracleDrafts(references, 3, vocab_size)
        oracle = parallel.generate(PROMPTS, params, use_tqdm=False)
        assert_same(plain, oracle)
        for out in oracle:  # every row, the structured ones too
            assert 0 < out.metrics.spec_decode.num_accepted_tokens < out.metrics.spec_decode.num_draft_tokens
    finally:
        parallel.engine.shutdown()


def test_tp2_with_mtp_drafts_equals_tp1_without(qwen3_5_mtp_dir):
    """Each rank runs its shard of the MTP layer (its KV heads in one more KV-pool layer) and feeds rank
    0's drafts; the tokens are TP=1's without speculation, and the schedule of drafts TP=1's with MTP.
    (The tiny random MTP layer's drafts are rejected at TP=1 and TP=2 alike.)"""
    model_dir, params = qwen3_5_mtp_dir, params_list()[:2]
    runs = []
    for tp, speculative_config in ((1, None), (1, MTP), (2, MTP)):
        llm = LLM(str(model_dir), **engine_options(model_dir, tp), speculative_config=speculative_config)
        try:
            runs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        finally:
            llm.engine.shutdown()
    plain, single, parallel = runs
    assert_same(plain, parallel)
    assert [o.metrics.spec_decode for o in parallel] == [o.metrics.spec_decode for o in single]
    assert all(o.metrics.spec_decode.num_draft_tokens > 0 for o in parallel)


def test_each_rank_loads_its_share_of_the_mtp_layer(qwen3_5_mtp_dir):
    """The MTP layer's attention heads and MLP are sliced per rank as the decoder layers' are; fc whole."""
    from vlmrun.config import EngineConfig, ModelConfig
    from vlmrun.models import load_model
    from vlmrun.parallel import TensorParallel
    from vlmrun.executor.mtp_drafter import build_mtp_drafter

    config = EngineConfig(model=str(qwen3_5_mtp_dir), dtype="float32", device="cpu", speculative_config=MTP)
    model_config = ModelConfig.from_path(qwen3_5_mtp_dir, config, torch.device("cpu"))
    cpu = torch.device("cpu")
    whole = build_mtp_drafter(load_model(model_config, cpu), config, model_config, 4, cpu).mtp
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        shard = build_mtp_drafter(load_model(model_config, cpu, tp), config, model_config, 4, cpu, tp).mtp
        assert torch.equal(shard.fc.weight, whole.fc.weight)
        for name, param in shard.layers[0].named_parameters():
            full = dict(whole.layers[0].named_parameters())[name]
            if param.shape == full.shape:
                assert torch.equal(param, full), name
            else:  # one dimension halved: this rank's contiguous half of it (fused projections: of each part)
                assert param.numel() * 2 == full.numel(), name
        attn, ref = shard.layers[0].self_attn, whole.layers[0].self_attn
        assert ref.o_proj.weight.shape[1] == 2 * attn.o_proj.weight.shape[1]
        half = attn.o_proj.weight.shape[1]
        assert torch.equal(attn.o_proj.weight, ref.o_proj.weight[:, rank * half:(rank + 1) * half])
