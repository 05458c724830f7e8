"""The local runner under async scheduling: step N+1 is planned and launched while step N runs.

The engine launches a step, then collects the one it launched before (`Engine.step`). Two things
make that safe here:

- **Cache writes in step order.** The scheduler writes page-table rows, zeroes GDN slots and saves
  or restores GDN snapshots while a step may be running. It writes them into stand-in caches
  (`vlmrun.cache.shadow`, as under tensor parallelism) and each launch applies the writes
  recorded since the last one to the real pools just before its own work: after the step before
  it, whichever thread or stream runs it. A row or page freed while a step still reads it can be
  handed out at once; its new owner's writes land after that step.
- **Where a step runs.** On CUDA, `launch` queues the step's kernels on the stream and returns;
  the stream keeps the order. On the CPU a single worker thread runs the steps, one after the
  other, while the engine's thread plans the next one (torch releases the GIL inside its ops).

The tokens a launched step samples stay on the device (`ModelRunner.last_tokens`); the next step's
inputs read them there (`PLACEHOLDER_TOKEN`), and the host gets them when it collects.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Union

import torch

from vlmrun.cache.shadow import CacheOp, build_shadow_caches, replay_cache_ops
from vlmrun.executor.model_runner import LaunchedStep, ModelRunner
from vlmrun.executor.step_output import ChunkOutput, DecodedRows
from vlmrun.executor.step_input import ChunkInput, DecodeRows
from vlmrun.lora.request import LoRARequest

Handle = Union[LaunchedStep, Future]


class OverlappedExecutor:
    """A `ModelRunner` behind stand-in caches, whose steps run in order on their own thread or stream."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.model = runner.model
        self.weight_bytes = runner.weight_bytes
        self.caches, self._cache_ops = build_shadow_caches(runner.model.cache_shape(), runner.caches.plan)
        self._worker: Optional[ThreadPoolExecutor] = None
        if runner.device.type != "cuda":
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrun-step")

    def make_generator(self, seed: int) -> torch.Generator:
        return self.runner.make_generator(seed)

    def add_lora(self, request: LoRARequest) -> None:
        self.runner.add_lora(request)

    @property
    def takes_decode_rows(self) -> bool:
        return self.runner.takes_decode_rows

    def launch(self, chunks: list[ChunkInput], decodes: Optional[DecodeRows] = None) -> Handle:
        ops = self._cache_ops.drain()
        if self._worker is None:
            return self._launch(ops, chunks, decodes)
        return self._worker.submit(self._run, ops, chunks, decodes)

    def collect(self, handle: Handle) -> list[ChunkOutput]:
        return self.collect_step(handle)[0]

    def collect_step(self, handle: Handle) -> tuple[list[ChunkOutput], Optional[DecodedRows]]:
        if isinstance(handle, Future):
            return handle.result()
        return self.runner.collect_step(handle)

    def execute(self, chunks: list[ChunkInput]) -> list[ChunkOutput]:
        return self.collect(self.launch(chunks))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _launch(self, ops: list[CacheOp], chunks: list[ChunkInput], decodes: Optional[DecodeRows]) -> LaunchedStep:
        replay_cache_ops(self.runner.caches, ops)
        return self.runner.launch(chunks, decodes)

    def _run(self, ops: list[CacheOp], chunks: list[ChunkInput],
             decodes: Optional[DecodeRows]) -> tuple[list[ChunkOutput], Optional[DecodedRows]]:
        """A whole step on the worker thread (the CPU)."""
        return self.runner.collect_step(self._launch(ops, chunks, decodes))
