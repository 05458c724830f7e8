"""What a tensor-parallel step sends its ranks, and where the ranks run (no rank processes here).

A step message carries compact tensors (a view pickles its whole storage), pixels on the CPU, of a
request's history only what the sampler reads, and a seeded request's generator as a key and a seed
(the generators live in the ranks).
Ray ranks take the GPU Ray gave them and a cluster that cannot hold them is an error, not a wait.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from vlmrun.cache.plan import CachePlan
from vlmrun.config import CacheShape
from vlmrun.executor.ranks import DriverState, RankFailure, RankGenerators
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.processors import MMItem
from vlmrun.sampling_params import SamplingParams

PROMPT_LEN = 32768


def decode_chunk(params: SamplingParams, generator=None, outputs: int = 40) -> ChunkInput:
    """A decode chunk of a request with a long prompt, its tensors views of request-sized ones."""
    positions = torch.arange(3 * PROMPT_LEN, dtype=torch.int64).view(3, PROMPT_LEN)
    step_slots = torch.arange(4096, dtype=torch.int64)
    prompt, output = list(range(PROMPT_LEN)), list(range(outputs))
    return ChunkInput(row=1, start=PROMPT_LEN + outputs - 1, token_ids=[7], positions=positions[:, -1:],
                      kv_slots=step_slots[5:6], mm_items=(),
                      sampling=SamplingRow(params, prompt, output, generator, eos_token_ids=(2,)))


def driver() -> DriverState:
    shape = CacheShape(num_attention_layers=1, num_kv_heads=1, head_dim=8)
    plan = CachePlan(num_pages=8, page_size=16, max_model_len=128, max_num_seqs=4, kv_bytes_per_token=32,
                     gdn_bytes_per_request=0, num_gdn_slots=0)
    return DriverState(shape, plan)


def wire(chunk: ChunkInput) -> ChunkInput:
    return driver().step_message([chunk])[2][0]


def test_a_decode_step_message_is_small() -> None:
    chunk = decode_chunk(SamplingParams(max_tokens=8))
    assert len(pickle.dumps(chunk.positions)) > 700_000  # the view carries the whole [3, 32768] storage
    message = driver().step_message([chunk])
    size = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert size < 4_000, size
    sent = message[2][0]
    assert torch.equal(sent.positions, chunk.positions) and torch.equal(sent.kv_slots, chunk.kv_slots)
    assert sent.sampling.prompt_token_ids == [] and sent.sampling.output_token_ids == []


@pytest.mark.parametrize("params, prompt_sent, outputs_sent", [
    (SamplingParams(repetition_penalty=1.2), PROMPT_LEN, 40),  # prompt + output ids
    (SamplingParams(presence_penalty=0.5), 0, 40),
    (SamplingParams(frequency_penalty=-0.5), 0, 40),
    (SamplingParams(min_tokens=100, max_tokens=200), 0, 40),  # still short of min_tokens: the sampler sees 40 < 100
    (SamplingParams(min_tokens=10), 0, 10),  # past it: 10 ids say "min_tokens reached", like 40 do
])
def test_the_sampler_gets_the_history_it_reads(params, prompt_sent, outputs_sent) -> None:
    chunk = decode_chunk(params)
    row = wire(chunk).sampling
    assert (len(row.prompt_token_ids), len(row.output_token_ids)) == (prompt_sent, outputs_sent)
    assert list(row.output_token_ids) == list(chunk.sampling.output_token_ids[:outputs_sent])
    reaches = len(row.output_token_ids) < params.min_tokens
    assert reaches == (len(chunk.sampling.output_token_ids) < params.min_tokens)


def test_pixels_travel_on_the_cpu() -> None:
    device = "cuda" if torch.cuda.is_available() else "meta"  # a device tensor; "meta" stands in without CUDA
    pixels = torch.ones(4, 6, device=device)
    item = MMItem(hash="h", offset=0, length=1, pixel_values=pixels, grid_thw=(1, 2, 2))
    chunk = replace(decode_chunk(SamplingParams()), mm_items=[item], sampling=None)
    if device == "meta":
        with pytest.raises(NotImplementedError):  # meta tensors cannot be copied to the CPU: proof it tried
            wire(chunk)
        return
    assert wire(chunk).mm_items[0].pixel_values.device.type == "cpu"


def test_seeded_generators_live_in_the_ranks_by_key() -> None:
    """The driver sends a key and a seed; a rank seeds a generator at the key's first step and goes
    on with it (drawing what one generator draws), and drops it once the driver dropped its key."""
    state = driver()
    kept = state.make_generator(11)
    rank = RankGenerators(torch.device("cpu"))
    reference = torch.Generator().manual_seed(11)
    for _ in range(3):
        message = state.step_message([decode_chunk(SamplingParams(temperature=1.0, seed=11), kept)])
        (sent,) = message[3]
        assert sent == (kept.key, 11) and message[2][0].sampling.generator is None
        rank.release(message[4])
        assert torch.equal(torch.rand(5, generator=rank.take(sent)), torch.rand(5, generator=reference))
    other = state.make_generator(12)
    assert other.key != kept.key
    key = kept.key
    del kept  # the request is gone: its key goes with the next step, and the rank drops the generator
    message = state.step_message([decode_chunk(SamplingParams(), None)])
    assert message[4] == [key] and message[3] == [None]
    rank.release(message[4])
    assert key not in rank.by_key


def test_ray_ranks_take_the_gpu_ray_gave_them() -> None:
    from vlmrun.executor.ray_executor import ray_cuda_index

    assert ray_cuda_index([3], "3") == 0  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU
    assert ray_cuda_index(["2"], "0,1,2,3") == 2  # not narrowed (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
    assert ray_cuda_index([1], None) == 1
    with pytest.raises(RankFailure, match="hides"):
        ray_cuda_index([5], "0,1")
    with pytest.raises(RankFailure, match="no GPU"):
        ray_cuda_index([], "0")


def test_a_ray_cluster_too_small_for_the_ranks_is_an_error_not_a_wait() -> None:
    ray = pytest.importorskip("ray")
    from vlmrun.config import EngineConfig
    from vlmrun.executor.ray_executor import cluster_device, place_ranks

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(RankFailure, match=r"cannot place 2 ranks of \{'CPU': 1\}: the whole cluster has 1 CPU"):
            place_ranks({"CPU": 1}, 2)
        assert cluster_device(EngineConfig(tensor_parallel_size=2)).type == "cpu"  # "auto", no GPU in the cluster
        with pytest.raises(ValueError, match="needs 2 GPUs in the cluster; it has 0"):
            cluster_device(EngineConfig(tensor_parallel_size=2, device="cuda"))
    finally:
        ray.shutdown()


def test_every_executor_has_the_executor_interface() -> None:
    """The engine drives `Engine.executor` through `vlmrun.executor.base.Executor` alone."""
    from vlmrun.executor.base import Executor
    from vlmrun.executor.distributed import TensorParallelExecutor
    from vlmrun.executor.model_runner import ModelRunner
    from vlmrun.executor.ray_executor import RayExecutor

    methods = [name for name in dir(Executor) if not name.startswith("_")]
    assert set(methods) >= {"execute", "make_generator", "shutdown"}
    for cls in (ModelRunner, TensorParallelExecutor, RayExecutor):
        missing = [name for name in methods if not callable(getattr(cls, name, None))]
        assert not missing, (cls.__name__, missing)
