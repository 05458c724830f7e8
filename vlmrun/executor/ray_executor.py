"""The tensor-parallel executor on Ray (`distributed_executor_backend="ray"`): ranks across nodes.

The ranks are Ray actors placed by a placement group (one bundle per rank: a GPU on CUDA, a CPU
otherwise; packed onto as few nodes as fit) on the Ray cluster `ray.init()` finds (RAY_ADDRESS, or
a cluster started with `ray start` on each node; without one, Ray starts a local one). vlmrun
manages no cluster of its own. Each actor runs the same rank code as the local executor
(`vlmrun/executor/worker.py`); rank 0's node address is the process group's rendezvous. The ranks'
device is the cluster's (`cluster_device`: "auto" is CUDA when the cluster has a GPU per rank, even if
the driver has none) and each actor uses the GPU Ray gave it (`ray_cuda_index`); a cluster that cannot
hold the ranks is an error at start-up, not a wait without end (`place_ranks`).

A step is pickled once and put in Ray's object store once; every rank's `execute` reads it from
there. The driver waits on all ranks' calls together, so a rank that raises or whose actor dies
(`RayActorError`) stops the engine at once with `RankFailure`; `shutdown()` kills the actors and
removes the placement group.
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from typing import Any, Optional

import torch

from vlmrun.cache.plan import CachePlan
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.executor.ranks import DriverState, RankFailure, RankGenerator, free_port, plan_for_ranks
from vlmrun.executor.step_output import ChunkOutput
from vlmrun.executor.step_input import ChunkInput
from vlmrun.executor.worker import Worker, start_rank

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
PLACEMENT_TIMEOUT_SECONDS = 120.0


class RankActor:
    """One rank in a Ray actor (made remote with `ray.remote` when the executor starts)."""

    def __init__(self) -> None:
        self.worker: Optional[Worker] = None
        self.rank = -1

    def rendezvous(self) -> str:
        """A process-group address on this actor's node (asked of rank 0)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, rank: int, size: int, config: EngineConfig, model_config: ModelConfig, init_method: str,
              device_type: str) -> tuple:
        device = torch.device("cpu")
        if device_type == "cuda":
            import ray

            device = torch.device("cuda", ray_cuda_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
        self.rank = rank
        self.worker = start_rank(rank, size, config, model_config, init_method, device)
        return ("ready", self.worker.cache_budget(), self.worker.cache_shape())

    def build(self, plan: CachePlan) -> int:
        return self.worker.build(plan)

    def execute(self, payload: bytes) -> Optional[tuple]:
        results = self.worker.execute(*pickle.loads(payload)[1:])
        return ("result", results) if self.rank == 0 else None


class RayExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device):
        """`device`: the ranks' device type, from the cluster (`cluster_device`), not this process's."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.size = config.tensor_parallel_size
        gpu = device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.placement_group = place_ranks(bundle, self.size)
        actor_cls = ray.remote(RankActor)
        self.actors = [
            actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.size)]
        self._finalizer = weakref.finalize(self, stop_actors, self.actors, self.placement_group)
        init_method = self._get([self.actors[0].rendezvous.remote()])[0]
        ready = self._get([a.start.remote(r, self.size, config, model_config, init_method, device.type)
                           for r, a in enumerate(self.actors)])
        shape, plan = plan_for_ranks(ready, config, model_config)
        self.weight_bytes = tuple(self._get([a.build.remote(plan) for a in self.actors]))
        self.driver = DriverState(shape, plan)
        self.caches = self.driver.caches
        logger.info("tensor parallel on Ray: %d rank actors in placement group %s; the cache plan below is each "
                    "rank's", self.size, self.placement_group.id.hex())

    def execute(self, chunks: list[ChunkInput]) -> list[ChunkOutput]:
        return self.collect(self.launch(chunks))

    def launch(self, chunks: list[ChunkInput]) -> list:
        """Put the step in Ray's object store once and start every rank's `execute` on it."""
        import ray

        if not self._finalizer.alive:
            raise RankFailure("the tensor-parallel executor is shut down")
        payload = ray.put(pickle.dumps(self.driver.step_message(chunks), protocol=pickle.HIGHEST_PROTOCOL))
        return [a.execute.remote(payload) for a in self.actors]  # an actor runs its calls in order

    def collect(self, refs: list) -> list[ChunkOutput]:
        return self._get(refs)[0][1]

    def add_lora(self, request: Any) -> None:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: LoRA is not supported with the Ray executor yet")

    def make_generator(self, seed: int) -> RankGenerator:
        return self.driver.make_generator(seed)

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


def cluster_device(config: EngineConfig) -> torch.device:
    """The ranks' device, as the Ray cluster can give it (starting or joining the cluster first): with
    `device="auto"` CUDA when the cluster has a GPU for every rank, the CPU when it has none. This
    process's own device does not count: a driver without a GPU may drive GPU ranks."""
    import ray

    if not ray.is_initialized():
        ray.init()
    need = config.tensor_parallel_size
    gpus = ray.cluster_resources().get("GPU", 0)
    device = torch.device("cuda" if gpus else "cpu") if config.device == "auto" else torch.device(config.device)
    if device.type == "cuda" and gpus < need:
        raise ValueError(f"tensor_parallel_size={need} on Ray needs {need} GPUs in the cluster; it has {gpus:g} "
                         "(lower tensor_parallel_size, add GPU nodes, or set device='cpu')")
    return device


def place_ranks(bundle: dict, size: int) -> Any:
    """A ready placement group of `size` bundles. A cluster that can never hold them, or whose resources
    are not free within PLACEMENT_TIMEOUT_SECONDS, is an error naming what is missing (Ray itself would
    wait forever)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    short = [k for k, v in bundle.items() if total.get(k, 0) < v * size]
    if short:
        have = ", ".join(f"{total.get(k, 0):g} {k}" for k in short)
        raise RankFailure(f"Ray cannot place {size} ranks of {bundle}: the whole cluster has {have}")
    group = placement_group([bundle] * size, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
    except GetTimeoutError:
        remove_placement_group(group)
        raise RankFailure(f"Ray could not place {size} ranks of {bundle} within {PLACEMENT_TIMEOUT_SECONDS:g} s: "
                          f"free now {ray.available_resources()}") from None
    return group


def ray_cuda_index(gpu_ids: list, visible_devices: Optional[str]) -> int:
    """The torch index of an actor's GPU. Ray gives the actor its GPU ids and, unless told not to,
    narrows CUDA_VISIBLE_DEVICES to them: the index is the id's place in that list (0 when narrowed)."""
    if not gpu_ids:
        raise RankFailure("this Ray actor was given no GPU")
    gpu = str(gpu_ids[0])
    if not visible_devices:
        return int(gpu)
    visible = [d.strip() for d in visible_devices.split(",")]
    if gpu not in visible:
        raise RankFailure(f"Ray gave this actor GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible_devices} hides")
    return visible.index(gpu)


def stop_actors(actors: list, group: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)
