"""One tensor-parallel rank: its own model shard, caches shard and `ModelRunner`, driven by the executor.

`run_worker` is the body of each rank's process (`vlmrun/executor/distributed.py` starts them).
It joins the process group (gloo on CPU, NCCL on CUDA), builds the model with this rank's
`TensorParallel` (each sharded layer reads only its slice of the checkpoint), reports the cache
budget it can afford and the cache shape of its shard, builds its pools from the plan the driver
sends back, and then serves steps until told to stop:

    driver -> rank   ("plan", CachePlan) | ("step", cache ops, [ChunkInput], generators) | ("stop",)
    rank -> driver   ("ready", budget bytes, CacheShape) | ("built",) | ("result", ...) (rank 0) | ("error", text)

Every rank replays the step's cache ops on its pools (`vlmrun.cache.shadow`), encodes the step's
images itself (the vision tower is replicated) and runs the model; the layers' collectives keep
the ranks in step. Rank 0's samples are the step's result. Seeded requests' generators travel as
their seed, then their state (`ranks.RankGenerator`): rank 0 samples with them and sends the
advanced states back.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Optional

import torch
import torch.distributed

from vlmrun.cache.plan import CachePlan, build_pools, cache_budget_bytes
from vlmrun.cache.shadow import replay_cache_ops
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.executor.build import build_model_runner
from vlmrun.executor.model_runner import ModelRunner
from vlmrun.executor.ranks import GeneratorWire
from vlmrun.executor.step_input import ChunkInput
from vlmrun.models import load_model
from vlmrun.parallel import TensorParallel

PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)

GeneratorStates = list[Optional[torch.Tensor]]  # per chunk: its request's generator state after the step, or None


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
        self.model = load_model(model_config, device, tp)
        self.runner: Optional[ModelRunner] = None

    def cache_budget(self) -> int:
        return cache_budget_bytes(self.config, self.device)

    def build(self, plan: CachePlan) -> None:
        dtype = self.model_config.dtype
        caches = build_pools(self.model.cache_shape(), plan, self.config, dtype=dtype, device=self.device)
        self.runner = build_model_runner(self.model, caches, self.config, self.device, dtype, tp=self.tp)

    def execute(self, ops: list, chunks: list[ChunkInput],
                generators_in: list[GeneratorWire]) -> tuple[list, GeneratorStates]:
        replay_cache_ops(self.runner.caches, ops)
        generators = [self._generator(g) for g in generators_in]
        for chunk, generator in zip(chunks, generators):
            if generator is not None:
                chunk.sampling = chunk.sampling._replace(generator=generator)
        results = self.runner.execute(chunks)
        return results, [None if g is None else g.get_state() for g in generators]

    def _generator(self, wire: GeneratorWire) -> Optional[torch.Generator]:
        """A seeded request's generator on this rank's device: seeded at its first sampling step, else
        set to the state the last step left."""
        if wire is None:
            return None
        seed, state = wire
        generator = torch.Generator(device=self.device)
        if state is None:
            generator.manual_seed(seed)
        else:
            generator.set_state(state)
        return generator


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
    """A rank's process: build, then serve steps until ("stop",) or the driver's end of `conn` closes."""
    try:
        worker = start_rank(rank, size, config, model_config, init_method, rank_device(config, rank))
        conn.send(("ready", worker.cache_budget(), worker.model.cache_shape()))
        _, plan = conn.recv()
        worker.build(plan)
        conn.send(("built",))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            _, ops, chunks, states = message
            results, states = worker.execute(ops, chunks, states)
            if rank == 0:
                conn.send(("result", results, states))
        torch.distributed.destroy_process_group()
    except EOFError:  # the driver went away
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
