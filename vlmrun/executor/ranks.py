"""What both tensor-parallel executors (`distributed.py`: local processes, `ray_executor.py`: Ray
actors) share: the error a failed rank raises, the message a step travels in, the one cache plan
for the ranks, a free TCP port for the process group's rendezvous."""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from typing import Optional

import torch

from vlmrun.cache.plan import CachePlan, plan_for_budget
from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.sampling_batch import SamplingRow


class RankFailure(RuntimeError):
    """A tensor-parallel rank raised or died; the engine cannot go on."""


@dataclass
class RankGenerator:
    """A seeded request's generator as a tensor-parallel driver keeps it: plain CPU data.

    The driver never builds a device generator (on CUDA that would open a context on GPU 0 after rank 0
    planned its memory): the first step that samples sends the seed, rank 0 seeds a generator on its own
    device, samples with it and sends its state back; later steps send that state."""

    seed: int
    state: Optional[torch.Tensor] = None  # rank 0's generator state after the last step that sampled

    def as_wire(self) -> tuple[int, Optional[torch.Tensor]]:
        return self.seed, self.state


GeneratorWire = Optional[tuple[int, Optional[torch.Tensor]]]  # (seed, state or None), or None: unseeded


class StepMessage:
    """One step as the ranks get it: ("step", cache ops, chunks as the ranks need them, generators).

    What travels is what a rank reads, in storages of its own size (a tensor that views a larger one
    pickles the whole storage): positions and KV slots as compact copies, pixels on the CPU (each
    rank moves them to its own device), and of a request's token history only what the sampler
    reads this step (`_wire_sampling`). A seeded request's generator travels as `RankGenerator` data;
    rank 0 sends the advanced state back (`advance_generators`). A grammar's matcher stays in the
    driver too (the engine advances it): the ranks get the bitmask it allows next (`GrammarState.filled`)."""

    def __init__(self, chunks: list[ChunkInput], cache_ops: list):
        self.generators: list[Optional[RankGenerator]] = [
            c.sampling.generator if c.sampling is not None else None for c in chunks]
        wire = [_wire_chunk(c) for c in chunks]
        self.message = ("step", cache_ops, wire, [None if g is None else g.as_wire() for g in self.generators])

    def advance_generators(self, states: list[Optional[torch.Tensor]]) -> None:
        for generator, state in zip(self.generators, states):
            if generator is not None:
                generator.state = state


def _wire_chunk(chunk: ChunkInput) -> ChunkInput:
    items = [replace(it, pixel_values=it.pixel_values.cpu()) for it in chunk.mm_items]
    sampling = None if chunk.sampling is None else _wire_sampling(chunk.sampling)
    return replace(chunk, positions=chunk.positions.clone(), kv_slots=chunk.kv_slots.clone(), mm_items=items,
                   sampling=sampling)


def _wire_sampling(row: SamplingRow) -> SamplingRow:
    """A sampling row the ranks can take: no generator object, a filled bitmask for a grammar, and of
    the prompt and output ids only what the sampler reads: all of them for penalties, else the first
    `min_tokens` outputs (enough to tell whether min_tokens still holds)."""
    params = row.params
    prompt = row.prompt_token_ids if params.repetition_penalty != 1.0 else ()
    output = row.output_token_ids if params.penalizes else row.output_token_ids[:params.min_tokens]
    return row._replace(prompt_token_ids=list(prompt), output_token_ids=list(output), generator=None,
                        grammar=None if row.grammar is None else row.grammar.filled())


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
