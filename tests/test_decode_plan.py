"""How decode runs (`bucketed_steps.plan_bucketed_steps`, `build.make_bucketed_steps`): on CUDA padded exactly when
it is captured in CUDA graphs (the torch attention backend, LoRA, TP: unpadded, since padding rows
without a graph are pure extra work); on the CPU padded only when asked. And MoE decode is
capturable like dense decode: the experts take a sync-free way at every bucket (`SparseMoeBlock.
step_capturable`), padded MoE decode equals unpadded token for token, and the forward a graph would
capture reads nothing on the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.launch_sync_guard import LaunchSyncGuard
from vlmrun import LLM, SamplingParams
from vlmrun.executor.build import make_bucketed_steps
from vlmrun.executor.bucketed_steps import graph_capturable, plan_bucketed_steps
from vlmrun.layers.grouped_matmul import GATHER_BUDGET, runs_sync_free
from vlmrun.layers.moe import SparseMoeBlock

CUDA, CPU = "cuda", "cpu"


def test_plan_on_cuda_pads_only_what_it_captures():
    captured = plan_bucketed_steps(CUDA, eager=False, backend_captures=True, model_captures=True)
    assert captured.padded and captured.graphs
    for refusal in (dict(backend_captures=False, model_captures=True),  # the torch attention backend
                    dict(backend_captures=True, model_captures=False),  # experts reading counts on the host
                    dict(backend_captures=True, model_captures=True, tensor_parallel_size=2),
                    dict(backend_captures=True, model_captures=True, lora=True)):
        plan = plan_bucketed_steps(CUDA, eager=False, **refusal)
        assert not plan.padded and not plan.graphs, refusal
        assert "no CUDA graphs" in plan.why
    assert "attention_backend='flashinfer'" in plan_bucketed_steps(CUDA, False, False, True).why
    assert plan_bucketed_steps(CUDA, eager=True, backend_captures=True, model_captures=True) == \
        plan_bucketed_steps(CPU, eager=True, backend_captures=True, model_captures=True)
    assert not plan_bucketed_steps(CUDA, eager=True, backend_captures=True, model_captures=True).padded


def test_plan_on_the_cpu_pads_when_asked():
    asked = plan_bucketed_steps(CPU, eager=False, backend_captures=False, model_captures=True)
    assert asked.padded and not asked.graphs
    assert not plan_bucketed_steps(CPU, eager=True, backend_captures=False, model_captures=True).padded


def test_torch_backend_on_cuda_builds_no_padding(qwen3_dir):
    """`make_bucketed_steps` for a CUDA device with the torch attention backend: no padded runner (it used to
    build one that padded every decode step to its bucket and never captured it)."""
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enforce_eager=False)
    runner = llm.engine.executor
    assert runner.bucketed_steps is not None  # the CPU pads when asked
    assert not runner.attn_backend.supports_cuda_graph
    config = dataclasses.replace(llm.engine.config, enforce_eager=None)  # CUDA's default: not eager
    assert make_bucketed_steps(runner.model, runner.attn_backend, runner.caches, config, torch.device("cuda")) is None


def test_experts_capturable_where_a_sync_free_way_fits():
    """Torch's grouped GEMM runs sync-free on the CPU (any row count); on CUDA float32 (no fast grouped GEMM)
    only the gathered fallback is sync-free, within its budget, so a decode of that size can be captured."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # (no CUDA call: the dtype rules CUDA out first)
    assert runs_sync_free(1 << 20, 512, 384, cpu, torch.float32)
    assert runs_sync_free(64, 512, 384, cuda, torch.float32)  # 64 rows x 384 x 512 <= the budget (2 ** 25)
    assert not runs_sync_free(GATHER_BUDGET // (512 * 384) + 1, 512, 384, cuda, torch.float32)
    block = SparseMoeBlock(64, 24, 4, 2)
    assert block.step_capturable(256) and graph_capturable(block, 256)


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_moe_padded_decode_equals_unpadded_and_reads_nothing(request, monkeypatch, arch):
    """3 and 5 requests (buckets 4 and 8, requests leaving mid-batch): padded decode = unpadded, greedy tokens
    equal and logprobs within GEMM rounding; every padded forward (what a CUDA graph captures, after the
    backend's metadata is prepared) runs under the launch guard with nothing read on the host."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts = ["Tell me about the sea.", "One two three four", "Red green blue red green", "A cat sat.", "Hello"]
    limits = [8, 3, 8, 5, 1]
    forwards = []
    runs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=eager, max_num_seqs=8)
        padded = llm.engine.executor.bucketed_steps
        assert (padded is None) == eager
        if padded is not None:
            assert graph_capturable(padded.model, 8)
            model = padded.model

            def guarded(*args, **kwargs):
                with LaunchSyncGuard(host_inputs=[]):  # inputs: the runner's static buffers, device state
                    out = model(*args, **kwargs)
                forwards.append(args[0].shape[0])
                return out

            monkeypatch.setattr(padded, "model", guarded)
        for size in (3, 5):
            sampling = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=3) for n in limits[:size]]
            runs[eager, size] = llm.generate(prompts[:size], sampling, use_tqdm=False)
    assert 4 in forwards and 2 in forwards, forwards  # padded buckets ran (3 sequences as 4, ...)
    for size in (3, 5):
        for i, (ours, ref) in enumerate(zip(runs[False, size], runs[True, size], strict=True)):
            assert ours.token_ids == ref.token_ids, f"{arch}: request {i} of {size}"
            for got, want in zip(ours.logprobs, ref.logprobs):
                assert max(abs(got[t] - want[t]) for t in want) < 1e-4
