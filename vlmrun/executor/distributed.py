"""The tensor-parallel executor: the engine's runner when `tensor_parallel_size > 1`.

The scheduler stays in the driver (the engine's process); the model runs in one worker process
per rank (`vlmrun/executor/worker.py`), started here with torch.multiprocessing's spawn. Start-up:
every rank loads its shard and reports its cache budget; the driver plans the caches once for the
smallest budget (every rank holds the same pages and slots, each with its share of the heads),
logs that per-rank plan, and sends it to the ranks, which build their pools and report the bytes
their model shard takes (`weight_bytes`). The driver's own `caches` are stand-ins
(`vlmrun.cache.shadow`) that keep the scheduler's bookkeeping and record its writes.

`execute(chunks)` is the `ModelRunner.execute` of a single device: `launch` pickles the step once
(the recorded cache ops, the chunks, the seeded requests' generators), sends those bytes to every
rank, and `collect` waits for rank 0's samples. While it waits it watches every rank: a rank that raised (its
traceback comes back) or died (its exit code) stops the engine at once with `RankFailure`, and
every rank process is ended. `shutdown()` (also run when the executor is garbage-collected)
stops the ranks and waits for them to exit.
"""

from __future__ import annotations

import logging
import pickle
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

import torch
import torch.multiprocessing as mp

from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.executor.base import Executor
from vlmrun.executor.lora_check import LoRAChecker
from vlmrun.executor.step_output import ChunkOutput
from vlmrun.executor.ranks import DriverState, RankFailure, RankGenerator, free_port, plan_for_ranks
from vlmrun.executor.step_input import ChunkInput
from vlmrun.executor.worker import run_worker
from vlmrun.lora.request import LoRARequest

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 5.0


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.size = config.tensor_parallel_size
        self.config, self.model_config = config, model_config
        self._lora: Optional[LoRAChecker] = None
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=run_worker, name=f"vlmrun-tp-rank{rank}", daemon=True,
                                  args=(rank, self.size, config, model_config, init_method, child))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._inbox: list[list[tuple]] = [[] for _ in range(self.size)]
        self._num_launched = self._num_collected = 0  # steps sent, and steps whose result was read
        self._finalizer = weakref.finalize(self, stop_processes, self.processes, self.conns)
        self._starting = True
        ready = [self._receive(rank, "ready") for rank in range(self.size)]
        self._starting = False
        shape, plan = plan_for_ranks(ready, config, model_config)
        self._send(("plan", plan))
        self.weight_bytes = tuple(self._receive(rank, "built")[1] for rank in range(self.size))
        self.driver = DriverState(shape, plan)
        self.caches = self.driver.caches
        logger.info("tensor parallel: %d rank processes (pids %s); the cache plan below is each rank's", self.size,
                    self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def execute(self, chunks: list[ChunkInput]) -> list[ChunkOutput]:
        """Runs the chunks on every rank; returns rank 0's samples (as `ModelRunner.execute`)."""
        return self.collect(self.launch(chunks))

    def launch(self, chunks: list[ChunkInput]) -> int:
        """Send the step (with the cache writes recorded since the last one) to every rank; its number."""
        self._send(self.driver.step_message(chunks))
        self._num_launched += 1
        return self._num_launched

    def collect(self, step: int) -> list[ChunkOutput]:
        """Rank 0's samples of step number `step`. The ranks answer in order: the results of earlier
        steps nobody collected (their requests were dropped after an error) are read and dropped."""
        results: list[ChunkOutput] = []
        while self._num_collected < step:
            results = self._receive(0, "result")[1]
            self._num_collected += 1
        return results

    def make_generator(self, seed: int) -> RankGenerator:
        return self.driver.make_generator(seed)

    def add_lora(self, request: LoRARequest) -> None:
        """Check a LoRA adapter here (a bad one fails its request); the ranks read it before their next step.

        The checker skips an adapter it has seen, but every request is sent (the request's name, id and
        folder, not the tensors): a rank's `LoRAManager.add` marks the adapter as awaited by a step and
        refreshes its host copy's LRU place (reading it again if that copy was dropped), as one device's
        `add` does for each request, so a rank's step never reads an adapter from disk."""
        if self._lora is None:
            self._lora = LoRAChecker(self.config, self.model_config)
        self._lora.check(request)
        self._send(("lora", request))

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ messages

    def _send(self, message: tuple) -> None:
        self._check_running()
        self._take_ready(timeout=0.0)  # a rank that failed in a step still running stops us before we send more
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # once for every rank
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_status(rank)})")

    def _receive(self, rank: int, kind: str) -> tuple:
        """The next message of `rank` (of `kind`), watching every rank for errors and exits meanwhile."""
        self._check_running()
        while not self._inbox[rank]:
            self._take_ready(timeout=POLL_SECONDS)
        message = self._inbox[rank].pop(0)
        if message[0] != kind:
            self._fail(f"tensor-parallel rank {rank} answered {message[0]!r} where {kind!r} was due")
        return message

    def _take_ready(self, timeout: float) -> None:
        """Move the messages the ranks have sent into the inbox (waiting up to `timeout` for one); a rank
        that sent an error or died stops the engine."""
        for ready in wait(self.conns, timeout=timeout):
            sender = self.conns.index(ready)
            try:
                message = ready.recv()
            except (EOFError, OSError):
                self._fail(f"tensor-parallel rank {sender} died ({self._exit_status(sender)})")
            if message[0] == "error":
                self._fail(f"tensor-parallel rank {sender} failed:\n{message[1]}")
            self._inbox[sender].append(message)
        for r, process in enumerate(self.processes):
            if process.exitcode is not None:
                self._fail(f"tensor-parallel rank {r} died ({self._exit_status(r)})")

    def _check_running(self) -> None:
        if not self._finalizer.alive:
            raise RankFailure("the tensor-parallel executor is shut down")

    def _exit_status(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            return f"pid {process.pid}, still running"
        return f"pid {process.pid}, " + (f"killed by signal {-code}" if code < 0 else f"exit code {code}")

    def _fail(self, reason: str) -> None:
        if self._finalizer.detach() is not None:  # no grace: the live ranks may be stuck in a collective
            stop_processes(self.processes, self.conns, grace_seconds=0.0)
        hint = ("\n(ranks are spawned processes that import the main module: a script that starts a "
                "tensor-parallel engine needs the `if __name__ == \"__main__\":` guard)") if self._starting else ""
        raise RankFailure(f"{reason}\nthe engine has stopped; every rank process was ended{hint}")


def stop_processes(processes: list[Any], conns: list[Connection], grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Ask every live rank to stop, wait up to `grace_seconds`, then terminate and kill what is left."""
    for process, conn in zip(processes, conns):
        if process.exitcode is None and grace_seconds > 0:
            try:
                conn.send(("stop",))
            except OSError:
                pass
    for process in processes:
        process.join(timeout=grace_seconds)
    for process in processes:
        if process.exitcode is None:
            process.terminate()
            process.join(timeout=STOP_GRACE_SECONDS)
        if process.exitcode is None:
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def executor_device(config: EngineConfig) -> torch.device:
    """The device the model runs on: this process's, or with Ray ranks the cluster's (`cluster_device`)."""
    if config.tensor_parallel_size > 1 and config.distributed_executor_backend == "ray":
        from vlmrun.executor.ray_executor import cluster_device

        return cluster_device(config)
    return config.resolve_device()


def create_parallel_executor(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> Executor:
    """The executor `config.distributed_executor_backend` names: "mp" (processes here) or "ray"."""
    if config.distributed_executor_backend == "ray":
        from vlmrun.executor.ray_executor import RayExecutor

        return RayExecutor(config, model_config, device)
    return TensorParallelExecutor(config, model_config)
