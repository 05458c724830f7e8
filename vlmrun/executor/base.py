"""The executor interface: what the engine drives, whatever runs the model.

Four executors implement it: `ModelRunner` (the model on this process's device), `OverlappedExecutor`
(the same under async scheduling, `overlap.py`), `TensorParallelExecutor` (one process per rank,
`distributed.py`) and `RayExecutor` (one Ray actor per rank, `ray_executor.py`). The engine holds
one as `Engine.executor` and never asks which. `execute(chunks)` is `collect(launch(chunks))`; the
engine launches a step and, under async scheduling, collects the one before it afterwards.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from vlmrun.cache.plan import Caches
from vlmrun.executor.step_output import ChunkOutput
from vlmrun.executor.step_input import ChunkInput


@runtime_checkable
class Executor(Protocol):
    caches: Caches  # the pools the scheduler writes its bookkeeping into (stand-ins under tensor parallel)
    weight_bytes: tuple[int, ...]  # the model's parameter bytes on each device (rank order), once built

    def execute(self, chunks: list[ChunkInput]) -> list[ChunkOutput]:
        """Run one step: per chunk, its sampled token (None for a chunk that does not sample) and prompt logprobs."""
        ...

    def launch(self, chunks: list[ChunkInput]) -> Any:
        """Start one step (the cache writes the scheduler made for it go first); a handle for `collect`."""
        ...

    def collect(self, handle: Any) -> list[ChunkOutput]:
        """Wait for a launched step: what `execute` returns. Steps are collected in launch order."""
        ...

    def add_lora(self, request: Any) -> None:
        """Read and check a LoRA adapter (`vlmrun.lora.request.LoRARequest`) before a request runs it; a
        ValueError naming it when it cannot run (or LoRA is off)."""
        ...

    def make_generator(self, seed: int) -> Any:
        """A seeded request's generator, in the form this executor samples with."""
        ...

    def shutdown(self) -> None:
        """Release what the executor started (rank processes, actors); safe to call twice."""
        ...
