"""Tensor parallelism on CPU (gloo): TP=2 (and TP=4 where the heads allow) equals TP=1.

Sharding rules and per-rank loading are checked in-process; the engine tests spawn one process per
rank (`vlmrun/executor/distributed.py`). Each architecture's TP=2 engine runs one scenario with
chunked prefill (a small token budget that also cuts image spans), the prefix cache (a second call
reuses a first call's prompt pages, GDN snapshots for the hybrid models) and preemption (a KV pool
too small for the batch), with greedy and seeded sampled requests, and must give the TP=1 engine's
tokens and, in float32, its logprobs within 2e-5 (absolute, plus 2e-5 relative). The two engines get the
same cache plan (the TP=2 budget is each rank's share), so they schedule alike. A last test kills a rank mid-run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from testing.tiny_models import ARCHS
from tests.conftest import make_sample_images
from vlmrun.api import LLM, SamplingParams
from vlmrun.structured import StructuredOutputsParams
from vlmrun.cache.plan import gdn_bytes_per_request, kv_bytes_per_token
from vlmrun.config import CacheShape
from vlmrun.executor.ranks import RankFailure
from vlmrun.loader import iter_lazy_weights, iter_weights
from vlmrun.models.registry import get_model_class
from vlmrun.models.weights import build_model
from vlmrun.parallel import Shard, TensorParallel

VL_ARCHS = {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}
DATA_PARALLEL_ENCODER = {"qwen3_vl", "qwen3_5_moe"}  # mm_encoder_tp_mode="data"; the other VL models "weights"
EXPERT_PARALLEL = {"qwen3_vl_moe"}  # whole experts per rank; the other MoE models slice every expert
KV_TOKENS = 12 * 16  # 12 pages: too few for the scenario's batch, so requests are preempted
MAX_NUM_SEQS = 4
SNAPSHOTS = 8
LOGPROB_TOL = 2e-5


# ---------------------------------------------------------------------------- sharding rules, in-process


def test_head_shards_split_or_replicate():
    assert [TensorParallel(r, 2).heads(4, 8) for r in range(2)] == [Shard(32, 0, 16), Shard(32, 16, 16)]
    # 2 KV heads on 4 ranks: each head on two consecutive ranks
    assert [TensorParallel(r, 4).heads(2, 8, replicate=True).start for r in range(4)] == [0, 0, 8, 8]
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the 2 heads"):
        TensorParallel(0, 4).heads(2, 8)
    with pytest.raises(ValueError, match="must divide the 6 KV heads or be a multiple"):
        TensorParallel(0, 4).heads(6, 8, "KV heads", replicate=True)


def test_cache_shape_per_rank(qwen3_5_dir):
    from transformers import AutoConfig

    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(qwen3_5_dir)))
    half = shape.for_tensor_parallel(2)
    assert (half.num_kv_heads, half.gdn_num_v_heads, half.gdn_conv_dim) == (
        shape.num_kv_heads // 2, shape.gdn_num_v_heads // 2, shape.gdn_conv_dim // 2)
    assert shape.for_tensor_parallel(4).num_kv_heads == 1  # 2 KV heads, replicated over 4 ranks
    assert shape.for_tensor_parallel(1) is shape


def test_each_rank_loads_its_slices(qwen3_dir):
    """Rank r's fused qkv rows are its q heads, then its k and v heads; o_proj its input columns."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(qwen3_dir))
    cls = get_model_class(config.architectures)
    full = dict(iter_weights(qwen3_dir))
    q, k, v = (full[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    o = full["model.layers.0.self_attn.o_proj.weight"]
    for rank in range(2):
        model = build_model(cls, config, torch.float32, torch.device("cpu"), TensorParallel(rank, 2))
        model.load_weights(iter_lazy_weights(qwen3_dir))
        attn = model.model.layers[0].self_attn
        qs, kvs = q.shape[0] // 2, k.shape[0] // 2
        expected = torch.cat([q[rank * qs:(rank + 1) * qs], k[rank * kvs:(rank + 1) * kvs],
                              v[rank * kvs:(rank + 1) * kvs]])
        assert torch.equal(attn.qkv_proj.weight, expected)
        assert torch.equal(attn.o_proj.weight, o[:, rank * o.shape[1] // 2:(rank + 1) * o.shape[1] // 2])
        vocab = full["model.embed_tokens.weight"]
        rows = model.model.embed_tokens.weight.shape[0]
        assert torch.equal(model.model.embed_tokens.weight, vocab[rank * rows:(rank + 1) * rows])


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_ranks_hold_sliced_or_whole_experts(qwen3_5_moe_dir, expert_parallel):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(qwen3_5_moe_dir))
    cls = get_model_class(config.architectures)
    cpu = torch.device("cpu")
    whole = build_model(cls, config, torch.float32, cpu)
    whole.load_weights(iter_weights(qwen3_5_moe_dir))
    ref = whole.language_model.layers[0].mlp.experts
    num_experts, units = ref.gate_up_proj.shape[0], ref.down_proj.shape[2]
    for rank in range(2):
        model = build_model(cls, config, torch.float32, cpu, TensorParallel(rank, 2, expert_parallel=expert_parallel))
        model.load_weights(iter_lazy_weights(qwen3_5_moe_dir))
        experts = model.language_model.layers[0].mlp.experts
        if expert_parallel:  # experts [rank * E/2, (rank + 1) * E/2), whole
            mine = slice(rank * num_experts // 2, (rank + 1) * num_experts // 2)
            assert torch.equal(experts.gate_up_proj, ref.gate_up_proj[mine])
            assert torch.equal(experts.down_proj, ref.down_proj[mine])
        else:  # every expert, units [rank * I/2, (rank + 1) * I/2) of gate, of up and of down's inputs
            mine = slice(rank * units // 2, (rank + 1) * units // 2)
            gate, up = ref.gate_up_proj.chunk(2, dim=1)
            assert torch.equal(experts.gate_up_proj, torch.cat([gate[:, mine], up[:, mine]], dim=1))
            assert torch.equal(experts.down_proj, ref.down_proj[:, :, mine])


# ---------------------------------------------------------------------------- engines, one process per rank


def engine_options(model_dir, tp: int) -> dict:
    """Small pools with the same plan at every tp: the budget is one rank's share of the TP=1 budget."""
    from transformers import AutoConfig

    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir))).for_tensor_parallel(tp)
    per_request = gdn_bytes_per_request(shape, torch.float32, torch.float32)
    budget = (KV_TOKENS + 15) * kv_bytes_per_token(shape, torch.float32) + (MAX_NUM_SEQS + 1 + SNAPSHOTS) * per_request
    return dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=40, kv_cache_memory_bytes=budget, gdn_prefix_snapshots=SNAPSHOTS,
                tensor_parallel_size=tp)


def user_turn(text: str) -> dict:
    """`text` as one user turn through the chat template (a plain string is the raw prompt)."""
    return {"prompt": text, "images": []}


def run_scenario(llm: LLM, with_images: bool) -> tuple[list, object]:
    """Two calls (the second hits the first's prefix pages); returns every output and the engine stats."""
    images = make_sample_images()
    shared = "A long shared opening about rivers, mountains, forests and the sea, told twice over. " * 2
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, logprobs=2, ignore_eos=True)
    first = [user_turn(shared), user_turn("Tell me a story."), user_turn("Count from one to ten.")]
    second = [user_turn(shared + "And then?"), user_turn("Tell me a story.")]
    if with_images:
        first += [{"prompt": "Describe the picture.", "images": [images[0]]},
                  {"prompt": "Compare the two pictures.", "images": [images[1], images[3]]}]
        second += [{"prompt": "Describe the picture.", "images": [images[0]]}]
    outputs = []
    for prompts in (first, second):
        params = [greedy] * (len(prompts) - 1) + [seeded]
        outputs += llm.generate(prompts, params, use_tqdm=False)
    return outputs, llm.engine.stats()


def assert_same_outputs(ours: list, reference: list) -> None:
    assert len(ours) == len(reference)
    for out, ref in zip(ours, reference):
        assert out.error is None and ref.error is None
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(ref.logprobs)
        for step, (lp, ref_lp) in enumerate(zip(out.logprobs, ref.logprobs)):
            assert lp.keys() == ref_lp.keys(), step
            for token, value in lp.items():  # float32: absolute 2e-5, plus 2e-5 relative (the MoE models'
                # experts split in two sum in another order, and F.linear's order may follow a shard's shape:
                # 2.75e-5 on a logprob of -1.74 with Qwen3.5-MoE on an AVX-512 Xeon, ~1.1e-5 near -4 elsewhere)
                assert abs(value - ref_lp[token]) <= LOGPROB_TOL * (1 + abs(ref_lp[token])), (step, token)


def same_plan(a: LLM, b: LLM) -> bool:
    pa, pb = a.engine.caches.plan, b.engine.caches.plan
    return (pa.num_pages, pa.max_num_seqs, pa.num_gdn_slots, pa.num_gdn_snapshots, pa.max_model_len) == (
        pb.num_pages, pb.max_num_seqs, pb.num_gdn_slots, pb.num_gdn_snapshots, pb.max_model_len)


def compare_tp(model_dir, arch: str, tp: int) -> LLM:
    """Runs the scenario at TP=1 and at `tp`; returns the TP engine (its ranks still running)."""
    reference = LLM(str(model_dir), **engine_options(model_dir, 1))
    ref_out, ref_stats = run_scenario(reference, arch in VL_ARCHS)
    mode = "data" if arch in DATA_PARALLEL_ENCODER else "weights"
    parallel = LLM(str(model_dir), **engine_options(model_dir, tp), mm_encoder_tp_mode=mode,
                   enable_expert_parallel=arch in EXPERT_PARALLEL)
    try:
        assert same_plan(parallel, reference)
        out, stats = run_scenario(parallel, arch in VL_ARCHS)
        assert_same_outputs(out, ref_out)
        assert stats.num_preemptions == ref_stats.num_preemptions > 0
        assert stats.prefix_hit_tokens == ref_stats.prefix_hit_tokens > 0
        whole = ref_stats.weight_bytes[0]  # each rank reports its shard's bytes: less than the whole model,
        assert len(stats.weight_bytes) == tp and all(0 < b < whole for b in stats.weight_bytes)
        assert sum(stats.weight_bytes) >= whole  # together at least all of it (the replicated parts on each)
    except BaseException:
        parallel.engine.shutdown()
        raise
    return parallel


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1(arch, request):
    llm = compare_tp(request.getfixturevalue(f"{arch}_dir"), arch, 2)
    llm.engine.shutdown()


def test_tp2_structured_outputs_match_tp1(qwen3_dir):
    """The grammar's matcher stays in the driver; rank 0 samples with the bitmask it filled."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
              "required": ["colour", "n"]}
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=8, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}"))]
    prompts = [user_turn("Describe the scene."), user_turn("Tell me a story."), user_turn("A code:")]
    reference = LLM(str(qwen3_dir), **engine_options(qwen3_dir, 1)).generate(prompts, params, use_tqdm=False)
    parallel = LLM(str(qwen3_dir), **engine_options(qwen3_dir, 2))
    try:
        outs = parallel.generate(prompts, params, use_tqdm=False)
    finally:
        parallel.engine.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert set(json.loads(outs[0].text)) == {"colour", "n"}
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", outs[2].text)


def test_tp4_with_replicated_kv_heads_then_a_rank_dies(qwen3_dir):
    """4 ranks over 2 KV heads; then rank 2 is killed mid-run: a clear error within seconds, no process left."""
    llm = compare_tp(qwen3_dir, "qwen3", 4)
    executor = llm.engine.executor
    pids = executor.pids
    os.kill(pids[2], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 2 died \(pid \d+, killed by signal 9\)"):
        llm.generate(["Tell me a story."] * 3, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 10
    assert not any(p.is_alive() for p in executor.processes)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RankFailure, match="shut down"):
        llm.generate(["again"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_ray_executor_tp2_matches_tp1(qwen3_5_dir):
    """Two CPU ranks as Ray actors in a placement group on a local Ray cluster."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        options = engine_options(qwen3_5_dir, 1)
        reference = LLM(str(qwen3_5_dir), **options)
        ref_out, _ = run_scenario(reference, True)
        options = dict(engine_options(qwen3_5_dir, 2), distributed_executor_backend="ray")
        llm = LLM(str(qwen3_5_dir), **options)
        try:
            assert type(llm.engine.executor).__name__ == "RayExecutor"
            out, _ = run_scenario(llm, True)
            assert_same_outputs(out, ref_out)
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()
