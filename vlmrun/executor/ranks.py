"""What both tensor-parallel executors (`distributed.py`: local processes, `ray_executor.py`: Ray
actors) share: the error a failed rank raises, the message a step travels in, the one cache plan
for the ranks, a free TCP port for the process group's rendezvous."""

from __future__ import annotations

import itertools
import socket
import weakref
from dataclasses import replace
from typing import Optional

import torch

from vlmrun.cache.plan import CachePlan, plan_for_budget
from vlmrun.cache.shadow import build_shadow_caches
from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.sampling_batch import SamplingRow


class RankFailure(RuntimeError):
    """A tensor-parallel rank raised or died; the engine cannot go on."""


class RankGenerator:
    """A seeded request's generator as a tensor-parallel driver knows it: a key and a seed.

    The generator itself lives in the ranks (`RankGenerators`): the first step that samples for the
    key seeds one on the rank's device, later steps go on with it. So the driver holds no device
    generator (on CUDA one would open a context on GPU 0 after rank 0 planned its memory), and no
    state travels back: a step launched before the last one is collected (async scheduling) draws
    what it would draw synchronously. When the driver drops the object, its key is sent with the next
    step, and the ranks drop theirs."""

    def __init__(self, key: int, seed: int, released: list[int]):
        self.key = key
        self.seed = seed
        weakref.finalize(self, released.append, key)


class RankGenerators:
    """A rank's seeded generators by key (see `RankGenerator`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.by_key: dict[int, torch.Generator] = {}

    def take(self, wire: GeneratorWire) -> Optional[torch.Generator]:
        if wire is None:
            return None
        key, seed = wire
        generator = self.by_key.get(key)
        if generator is None:
            generator = self.by_key[key] = torch.Generator(device=self.device).manual_seed(seed)
        return generator

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.by_key.pop(key, None)


GeneratorWire = Optional[tuple[int, int]]  # (key, seed) of a seeded request's generator, or None


class DriverState:
    """What both tensor-parallel executors keep in the driver: the scheduler's stand-in caches, the log
    of the writes made to them, and the keys of the seeded requests' generators.

    `step_message` is one step as the ranks get it: ("step", cache ops, chunks as the ranks need them,
    generators, generator keys released since the last step). What travels is what a rank reads, in
    storages of its own size (a tensor that views a larger one pickles the whole storage): positions
    and KV slots as compact copies, pixels on the CPU (each rank moves them to its own device), and of
    a request's token history only what the sampler reads this step (`_wire_sampling`). A seeded
    request's generator travels as its `RankGenerator` key and seed. A grammar's matcher stays in the
    driver too (the engine advances it): the ranks get the bitmask it allows next (`GrammarState.filled`),
    and with n-gram drafts the bitmasks after each draft (`DraftGrammar.filled`)."""

    def __init__(self, shape: CacheShape, plan: CachePlan):
        self.caches, self._cache_ops = build_shadow_caches(shape, plan)
        self._keys = itertools.count()
        self._released: list[int] = []  # appended to when a RankGenerator is dropped

    def make_generator(self, seed: int) -> RankGenerator:
        return RankGenerator(next(self._keys), seed, self._released)

    def step_message(self, chunks: list[ChunkInput]) -> tuple:
        n = len(self._released)  # a key a finalizer appends meanwhile goes with the next step
        released = self._released[:n]
        del self._released[:n]
        generators = [None if c.sampling is None or c.sampling.generator is None else
                      (c.sampling.generator.key, c.sampling.generator.seed) for c in chunks]
        return ("step", self._cache_ops.drain(), [_wire_chunk(c) for c in chunks], generators, released)


def _wire_chunk(chunk: ChunkInput) -> ChunkInput:
    items = [replace(it, pixel_values=it.pixel_values.cpu()) for it in chunk.mm_items]
    sampling = None if chunk.sampling is None else _wire_sampling(chunk.sampling)
    grammar = None if chunk.draft_grammar is None else chunk.draft_grammar.filled(chunk.draft_token_ids)
    positions = None if chunk.positions is None else chunk.positions.clone()
    return replace(chunk, positions=positions, kv_slots=chunk.kv_slots.clone(), mm_items=items,
                   sampling=sampling, draft_grammar=grammar)


def _wire_sampling(row: SamplingRow) -> SamplingRow:
    """A sampling row the ranks can take: no generator object, a filled bitmask for a grammar, and of
    the prompt and output ids only what the sampler reads: the prompt for a repetition penalty, all
    outputs for penalties or bad words, else the first `min_tokens` outputs (enough to tell whether
    min_tokens still holds). The params travel whole (logit_bias, allowed_token_ids, the bad words'
    token ids)."""
    params = row.params
    prompt = row.prompt_token_ids if params.repetition_penalty != 1.0 else ()
    output = row.output_token_ids if params.reads_output_tokens else row.output_token_ids[:params.min_tokens]
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
