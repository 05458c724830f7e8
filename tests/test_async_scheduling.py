"""Async scheduling equals the synchronous engine, token for token, logprobs within 5e-5.

With `async_scheduling=True` the engine plans and launches step N+1 before it reads step N's tokens
(`vlmrun/executor/overlap.py`; on the CPU step N runs on a worker thread meanwhile). Every
architecture runs one scenario both ways: a batch whose prompts are cut into chunks (image spans
included), preempted (a KV pool too small for the batch), prefix hits (GDN snapshots for the hybrid
models), greedy, seeded and n > 1 requests, stop strings that finish requests mid-batch. One model
runs the rows that must wait for their token (structured outputs, penalties, min_tokens), aborts of
running requests, the padded decode path and tensor parallel (TP=2). After each run the pools are
empty: nothing leaks.

Why 5e-5 and not 1e-6: async scheduling changes the schedule (a finished request frees its slot one
step later; a prompt's pages are indexed for prefix hits once their step is collected), and the
float32 CPU engine's logprobs depend on the schedule by that much on their own. Measured on this
scenario (qwen3 / qwen3_5), the synchronous engine with a token budget of 39 instead of 40 against
the same at 40: 3.2e-6 / 6.1e-6 on an AVX-512 CPU, 3.6e-6 / 1.7e-5 capped at AVX2
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2); async against sync: 3.6e-6 / 1.1e-5 and
3.1e-6 / 2.0e-5. Tokens are equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from testing.tiny_models import ARCHS
from tests.conftest import make_sample_images
from vlmrun import LLM, SamplingParams
from vlmrun.cache.plan import gdn_bytes_per_request, kv_bytes_per_token
from vlmrun.config import CacheShape, EngineConfig
from vlmrun.engine.engine import Engine
from vlmrun.structured import StructuredOutputsParams

VL_ARCHS = {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}
KV_TOKENS = 16 * 16  # 16 pages: too few for the scenario's batch, so requests are preempted
MAX_NUM_SEQS = 4
SNAPSHOTS = 8
LOGPROB_TOL = 5e-5  # the engine's own schedule sensitivity in float32, on AVX-512 and AVX2 (see above)


def engine_options(model_dir, **overrides) -> dict:
    """Small pools and a small token budget: chunked prefill, preemption and prefix hits happen. The
    budget holds KV_TOKENS tokens of KV (fewer than the scenario's batch needs) beside the GDN state."""
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    per_request = gdn_bytes_per_request(shape, torch.float32, torch.float32)
    budget = (KV_TOKENS + 15) * kv_bytes_per_token(shape, torch.float32) + (MAX_NUM_SEQS + 1 + SNAPSHOTS) * per_request
    options = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
                   max_num_batched_tokens=40, page_size=16, kv_cache_memory_bytes=budget,
                   gdn_prefix_snapshots=SNAPSHOTS, prefix_snapshot_interval=32)
    return {**options, **overrides}


def run_both(model_dir, prompts: list, params: list, **overrides) -> tuple[list, list]:
    """The same call on a synchronous and on an async engine; both engines are left empty."""
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), **engine_options(model_dir, async_scheduling=async_scheduling, **overrides))
        try:
            outputs.append(llm.generate(prompts, params, use_tqdm=False))
            assert_pools_empty(llm.engine)
        finally:
            llm.engine.shutdown()
    return outputs[0], outputs[1]


def assert_pools_empty(engine: Engine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished() and not engine.requests
    assert stats.num_running == stats.num_waiting == stats.req_rows_used == stats.kv_pages_used == 0
    assert stats.gdn_slots_used in (None, 0)


def assert_same(sync: list, ahead: list, logprob_tol: float = LOGPROB_TOL) -> None:
    assert len(sync) == len(ahead)
    for s, a in zip(sync, ahead):
        assert s.error is None and a.error is None
        assert len(s.outputs) == len(a.outputs)
        for cs, ca in zip(s.outputs, a.outputs):
            assert ca.token_ids == cs.token_ids and ca.text == cs.text and ca.finish_reason == cs.finish_reason
            assert (ca.logprobs is None) == (cs.logprobs is None)
            for step, (lp, ref) in enumerate(zip(ca.logprobs or [], cs.logprobs or [])):
                assert lp.keys() == ref.keys(), step
                assert all(abs(lp[t] - ref[t]) <= logprob_tol for t in lp), step


def scenario(with_images: bool) -> tuple[list, list]:
    images = make_sample_images()
    shared = "A long shared opening about rivers, mountains, forests and the sea, told twice over. " * 3
    prompts = [shared + "Tell me more.", "Tell me a story.", shared + "And then?", "Count from one to ten.",
               "Write a poem about the wind.", shared + "Once more."]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    params = [greedy,
              SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.0, stop=["e", "a"]),  # a stop string mid-batch
              SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
              greedy]
    if with_images:
        prompts += [{"prompt": "Describe the picture.", "images": [images[3]]},
                    {"prompt": "Compare the two pictures.", "images": [images[1], images[4]]},
                    {"prompt": "Describe the picture again.", "images": [images[3]]}]
        params += [greedy, SamplingParams(max_tokens=9, temperature=0.7, seed=11, ignore_eos=True), greedy]
    return prompts, params


@pytest.mark.parametrize("arch", ARCHS)
def test_async_equals_sync_on_every_architecture(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = scenario(arch in VL_ARCHS)
    sync, ahead = run_both(model_dir, prompts, params)
    assert_same(sync, ahead)


def test_the_scenario_preempts_and_hits_the_prefix_cache(qwen3_5_dir):
    """The scenario exercises what it claims to, with async scheduling on."""
    prompts, params = scenario(True)
    for async_scheduling in (False, True):
        llm = LLM(str(qwen3_5_dir), **engine_options(qwen3_5_dir, async_scheduling=async_scheduling))
        llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, async_scheduling


def test_rows_that_wait_for_their_token(qwen3_dir):
    """Structured outputs, penalties and min_tokens read the host's tokens: they wait for them, exactly."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
              "required": ["colour", "n"]}
    prompts = ["Describe the scene.", "A code:", "Tell me a story.", "Count to ten.", "Say something."]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}")),
              SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.4, logprobs=2),
              SamplingParams(max_tokens=12, min_tokens=10, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    sync, ahead = run_both(qwen3_dir, prompts, params)
    assert_same(sync, ahead)


def test_padded_decode_path(qwen3_5_dir):
    prompts, params = scenario(False)
    sync, ahead = run_both(qwen3_5_dir, prompts, params, enforce_eager=False)
    assert_same(sync, ahead)


def test_aborts_while_a_step_runs(qwen3_5_dir):
    """Requests aborted between steps (one of them in the launched step) leave nothing behind; the
    others give the synchronous engine's tokens."""
    config = EngineConfig(model=str(qwen3_5_dir), **engine_options(qwen3_5_dir, async_scheduling=True))
    engine = Engine(config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": engine.process(f"Request number {i} tells a story about the sea.") for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(30):
        if step == 4:
            assert engine._in_flight is not None and engine.requests["r1"].num_launched_steps
            engine.abort("r1")  # in the launched step
        if step == 6:
            engine.abort("r2")
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    assert_pools_empty(engine)
    reference = LLM(str(qwen3_5_dir), **engine_options(qwen3_5_dir)).generate(
        [f"Request number {i} tells a story about the sea." for i in range(4)], greedy, use_tqdm=False)
    assert tokens["r0"] == reference[0].token_ids and tokens["r3"] == reference[3].token_ids
    for rid, ref in (("r1", reference[1]), ("r2", reference[2])):
        assert len(tokens[rid]) < len(ref.token_ids) and tokens[rid] == ref.token_ids[:len(tokens[rid])]


def test_tensor_parallel(qwen3_5_dir):
    """TP=2: the driver sends step N+1 before it reads step N's result; every rank reads rank 0's
    sampled tokens (a broadcast) for its placeholders; seeded generators live in the ranks."""
    prompts, params = scenario(True)
    sync, ahead = run_both(qwen3_5_dir, prompts, params, tensor_parallel_size=2)
    assert_same(sync, ahead)


def test_a_caption_job_with_async_scheduling_writes_the_same_captions(qwen3_vl_dir, tmp_path):
    """`vlmrun caption --async-scheduling`: the caption pipeline reads the async engine's output."""
    from testing.image_folders import write_images
    from vlmrun.cli import main

    write_images(tmp_path / "imgs", 5, size=None, sizes_range=(40, 160), seed=5)
    captions = []
    for flag in ("--no-async-scheduling", "--async-scheduling"):
        out = tmp_path / f"{flag}.jsonl"
        assert main(["caption", str(tmp_path / "imgs"), "--out", str(out), "--model", str(qwen3_vl_dir),
                     "--max-tokens", "8", "--temperature", "0.7", "--seed", "3", "--dtype", "float32",
                     "--device", "cpu", flag]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        captions.append({r["image"]: (r["caption"], r["num_tokens"], r["finish_reason"]) for r in records})
    assert len(captions[0]) == 5 and captions[1] == captions[0]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
def test_async_equals_sync_on_cuda(arch, request):
    """On CUDA the stream orders the steps (no worker thread): the same scenario, float32, torch
    backends; logprobs within the CUDA float32 budget of the GPU engine tests (cuBLAS sums in another
    order per batch shape, and the schedules differ)."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = scenario(arch in VL_ARCHS)
    sync, ahead = run_both(model_dir, prompts, params, device="cuda")
    assert_same(sync, ahead, logprob_tol=2e-4)


def test_the_default_is_on_with_cuda_and_off_on_the_cpu(qwen3_dir):
    """None resolves per device: on with CUDA (confirmed equal on an H100), off on the CPU and with
    speculative decoding; what the user set wins. The engine runs with the resolved value."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig().overlaps_steps(cuda) and not EngineConfig().overlaps_steps(cpu)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert not EngineConfig(speculative_config=ngram).overlaps_steps(cuda)
    assert not EngineConfig(async_scheduling=False).overlaps_steps(cuda)
    assert EngineConfig(async_scheduling=True).overlaps_steps(cpu)
    assert LLM(str(qwen3_dir), device="cpu").engine.config.async_scheduling is False
