"""The tensor-parallel executor on Ray (`distributed_executor_backend="ray"`): ranks across nodes.

The ranks are Ray actors placed by a placement group (one bundle per rank: a GPU on CUDA, a CPU
otherwise; packed onto as few nodes as fit) on the Ray cluster `ray.init()` finds (RAY_ADDRESS, or
a cluster started with `ray start` on each node; without one, Ray starts a local one). vlmrun
manages no cluster of its own. Each actor runs the same rank code as the local executor
(`vlmrun/executor/worker.py`); rank 0's node address is the process group's rendezvous.

A step is pickled once and put in Ray's object store once; every rank's `execute` reads it from
there. The driver waits on all ranks' calls together, so a rank that raises or whose actor dies
(`RayActorError`) stops the engine at once with `RankFailure`; `shutdown()` kills the actors and
removes the placement group.
"""

from __future__ import annotations

import logging
import pickle
import weakref
from typing import Any, Optional

import torch

from vlmrun.cache.plan import CachePlan
from vlmrun.cache.shadow import build_shadow_caches
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.executor.ranks import RankFailure, StepMessage, free_port, plan_for_ranks
from vlmrun.executor.model_runner import SampledToken
from vlmrun.executor.step_input import ChunkInput
from vlmrun.executor.worker import Worker, start_rank

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2


class RankActor:
    """One rank in a Ray actor (made remote with `ray.remote` when the executor starts)."""

    def __init__(self) -> None:
        self.worker: Optional[Worker] = None
        self.rank = -1

    def rendezvous(self) -> str:
        """A process-group address on this actor's node (asked of rank 0)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, rank: int, size: int, config: EngineConfig, model_config: ModelConfig, init_method: str) -> tuple:
        device = torch.device("cuda", 0) if config.resolve_device().type == "cuda" else torch.device("cpu")  # Ray's GPU
        self.rank = rank
        self.worker = start_rank(rank, size, config, model_config, init_method, device)
        return ("ready", self.worker.cache_budget(), self.worker.model.cache_shape())

    def build(self, plan: CachePlan) -> None:
        self.worker.build(plan)

    def execute(self, payload: bytes) -> Optional[tuple]:
        _, ops, chunks, states = pickle.loads(payload)
        results, states = self.worker.execute(ops, chunks, states)
        return ("result", results, states) if self.rank == 0 else None


class RayExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        self.size = config.tensor_parallel_size
        gpu = config.resolve_device().type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * self.size, strategy="PACK")
        ray.get(self.placement_group.ready())
        actor_cls = ray.remote(RankActor)
        self.actors = [
            actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.size)]
        self._finalizer = weakref.finalize(self, stop_actors, self.actors, self.placement_group)
        init_method = self._get([self.actors[0].rendezvous.remote()])[0]
        ready = self._get([a.start.remote(r, self.size, config, model_config, init_method)
                           for r, a in enumerate(self.actors)])
        shape, plan = plan_for_ranks(ready, config, model_config)
        self._get([a.build.remote(plan) for a in self.actors])
        self.caches, self._cache_ops = build_shadow_caches(shape, plan)
        logger.info("tensor parallel on Ray: %d rank actors in placement group %s; the cache plan below is each "
                    "rank's", self.size, self.placement_group.id.hex())

    def execute(self, chunks: list[ChunkInput]) -> list[Optional[SampledToken]]:
        import ray

        if not self._finalizer.alive:
            raise RankFailure("the tensor-parallel executor is shut down")
        step = StepMessage(chunks, self._cache_ops.drain())
        payload = ray.put(pickle.dumps(step.message, protocol=pickle.HIGHEST_PROTOCOL))  # once for every rank
        _, results, states = self._get([a.execute.remote(payload) for a in self.actors])[0]
        step.advance_generators(states)
        return results

    def shutdown(self) -> None:
        self._finalizer()

    def _get(self, refs: list) -> list:
        """Every rank's answer; the first rank that raised or died stops the engine."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in done:
                try:
                    ray.get(ref)
                except (RayActorError, RayTaskError) as e:
                    rank = refs.index(ref)
                    self._finalizer()
                    raise RankFailure(f"tensor-parallel rank {rank} (Ray actor) failed: {e}\n"
                                      "the engine has stopped; every rank actor was ended") from e
        return ray.get(refs)


def stop_actors(actors: list, group: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)
