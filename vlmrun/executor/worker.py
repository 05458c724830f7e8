"""One tensor-parallel rank: its own model shard, caches shard and `ModelRunner`, driven by the executor.

`run_worker` is the body of each rank's process (`vlmrun/executor/distributed.py` starts them).
It joins the process group (gloo on CPU, NCCL on CUDA), builds the model with this rank's
`TensorParallel` (each sharded layer reads only its slice of the checkpoint), reports the cache
budget it can afford and the cache shape of its shard, builds its pools from the plan the driver
sends back, and then serves steps until told to stop:

    driver -> rank   ("plan", CachePlan) | ("step", cache ops, [ChunkInput], generators, released) | ("stop",)
    rank -> driver   ("ready", budget bytes, CacheShape) | ("built", weight bytes) | ("result", ...) (rank 0)
                     | ("error", text)

Every rank replays the step's cache ops on its pools (`vlmrun.cache.shadow`), encodes the step's
images itself (the vision tower is replicated) and runs the model; the layers' collectives keep
the ranks in step. Rank 0's samples are the step's result. Seeded requests' generators live in the
ranks, by the key the driver gives them (`ranks.RankGenerator`).
"""

from __future__ import annotations

import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Optional

import torch
import torch.distributed

from vlmrun.cache.plan import CachePlan, build_pools, cache_budget_bytes
from vlmrun.cache.shadow import replay_cache_ops
from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.executor.build import build_model_runner, load_kv_scales
from vlmrun.executor.model_runner import ModelRunner
from vlmrun.executor.ranks import GeneratorWire, RankGenerators
from vlmrun.executor.step_input import ChunkInput
from vlmrun.models import load_model
from vlmrun.parallel import TensorParallel
from vlmrun.executor.mtp_drafter import build_mtp_drafter, with_mtp_layer

PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)



def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU for every rank on CPU; the rank's own GPU (cuda:rank) on CUDA."""
    device = config.resolve_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_process_group(rank: int, size: int, device: torch.device, init_method: str) -> None:
    """Join the group and run one all_reduce at once, so that NCCL builds its communicator (and its
    buffers) now, before this rank measures the memory left for its caches, not in the first request."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                         world_size=size, timeout=PROCESS_GROUP_TIMEOUT,
                                         device_id=device if cuda else None)
    torch.distributed.all_reduce(torch.zeros(1, device=device))
    if cuda:
        torch.cuda.synchronize(device)


class Worker:
    """A rank's model shard, caches shard and runner."""

    def __init__(self, tp: TensorParallel, config: EngineConfig, model_config: ModelConfig, device: torch.device):
        self.tp = tp
        self.config = config
        self.model_config = model_config
        self.device = device
        self.model = load_model(model_config, device, tp, fp8_kernel=config.fp8_kernel)
        # speculative method "mtp": this rank's shard of the checkpoint's MTP layer (loaded before the caches)
        self.drafter = build_mtp_drafter(self.model, config, model_config, config.max_num_seqs, device, tp)
        self.runner: Optional[ModelRunner] = None
        self.generators = RankGenerators(device)

    def cache_budget(self) -> int:
        return cache_budget_bytes(self.config, self.device)

    def cache_shape(self) -> CacheShape:
        """This rank's share of the caches' shape (with the MTP layer's KV when it drafts)."""
        shape = self.model.cache_shape()
        return shape if self.drafter is None else with_mtp_layer(shape)

    def build(self, plan: CachePlan) -> int:
        """This rank's pools and runner; returns the bytes its model shard takes as it runs."""
        dtype = self.model_config.dtype
        caches = build_pools(self.cache_shape(), plan, self.config, dtype=dtype, device=self.device)
        load_kv_scales(caches, self.model, self.model_config.path)
        self.runner = build_model_runner(self.model, caches, self.config, self.device, dtype, tp=self.tp,
                                         drafter=self.drafter)
        return self.runner.weight_bytes[0]

    def execute(self, ops: list, chunks: list[ChunkInput], generators: list[GeneratorWire],
                released: list[int]) -> list:
        """One step message's parts (`DriverState.step_message`): replay the cache writes, run the chunks."""
        replay_cache_ops(self.runner.caches, ops)
        self.generators.release(released)
        for chunk, wire in zip(chunks, generators):
            if wire is not None:
                chunk.sampling = chunk.sampling._replace(generator=self.generators.take(wire))
        return self.runner.execute(chunks)


def start_rank(rank: int, size: int, config: EngineConfig, model_config: ModelConfig, init_method: str,
               device: torch.device) -> Worker:
    """Join the process group and load this rank's shard of the model."""
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // size)))
    init_process_group(rank, size, device, init_method)
    tp = TensorParallel(rank, size, expert_parallel=config.enable_expert_parallel)
    return Worker(tp, config, model_config, device)


def run_worker(rank: int, size: int, config: EngineConfig, model_config: ModelConfig, init_method: str,
               conn: Connection) -> None:
    """A rank's process: build, then serve steps until ("stop",) or the driver's end of `conn` closes.

    Messages to the driver go out on a thread of their own, in order: under async scheduling the
    driver may be sending the next step while this rank sends a result, and neither may wait for the
    other to read."""
    outbox = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrun-rank-send")
    try:
        worker = start_rank(rank, size, config, model_config, init_method, rank_device(config, rank))
        conn.send(("ready", worker.cache_budget(), worker.cache_shape()))
        _, plan = conn.recv()
        conn.send(("built", worker.build(plan)))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "lora":  # read a LoRA adapter (the driver checked it) before the steps that run it
                worker.runner.add_lora(message[1])
                continue
            results = worker.execute(*message[1:])
            if rank == 0:
                outbox.submit(conn.send, ("result", results))
        outbox.shutdown(wait=True)
        torch.distributed.destroy_process_group()
    except EOFError:  # the driver went away
        pass
    except BaseException:
        outbox.shutdown(wait=True)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
