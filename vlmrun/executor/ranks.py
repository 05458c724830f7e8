"""What both tensor-parallel executors (`distributed.py`: local processes, `ray_executor.py`: Ray
actors) share: the error a failed rank raises, the message a step travels in, the one cache plan
for the ranks, a free TCP port for the process group's rendezvous."""

from __future__ import annotations

import socket
from dataclasses import replace
from typing import Optional

import torch

from vlmrun.cache.plan import CachePlan, plan_for_budget
from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.sampling_batch import SamplingRow


class RankFailure(RuntimeError):
    """A tensor-parallel rank raised or died; the engine cannot go on."""


class StepMessage:
    """One step as the ranks get it: ("step", cache ops, chunks without their generators, generator states).

    A seeded request's generator stays in the driver; rank 0 samples with a copy made from its state
    and sends the advanced state back (`advance_generators`). A grammar's matcher stays in the driver
    too (the engine advances it): the ranks get the bitmask it allows next (`GrammarState.filled`)."""

    def __init__(self, chunks: list[ChunkInput], cache_ops: list):
        self.generators = [c.sampling.generator if c.sampling is not None else None for c in chunks]
        wire = [c if c.sampling is None else replace(c, sampling=_wire_sampling(c.sampling)) for c in chunks]
        states = [None if g is None else g.get_state() for g in self.generators]
        self.message = ("step", cache_ops, wire, states)

    def advance_generators(self, states: list[Optional[torch.Tensor]]) -> None:
        for generator, state in zip(self.generators, states):
            if generator is not None:
                generator.set_state(state)


def _wire_sampling(row: SamplingRow) -> SamplingRow:
    """A sampling row the ranks can take: no generator object, a filled bitmask for a grammar."""
    return row._replace(generator=None, grammar=None if row.grammar is None else row.grammar.filled())


def plan_for_ranks(ready: list[tuple], config: EngineConfig, model_config: ModelConfig) -> tuple[CacheShape, CachePlan]:
    """From every rank's ("ready", budget, cache shape): the shape of a rank's caches and the one plan
    every rank builds, for the smallest budget."""
    shape = ready[0][2]
    budget = min(message[1] for message in ready)
    return shape, plan_for_budget(shape, config, budget, dtype=model_config.dtype,
                                  max_model_len=model_config.max_model_len)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
