"""A request's state from arrival to finish: tokens, KV pages, M-RoPE positions, sampling state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Optional, Protocol

import torch

from vlmrun.executor.step_input import PLACEHOLDER_TOKEN
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.lora.request import LoRARequest
from vlmrun.pooling.pooler import PoolingState
from vlmrun.processors import ProcessedPrompt
from vlmrun.sampling_params import SamplingParams
from vlmrun.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


class ComputedTokens(Protocol):
    """Where a request's computed count is kept while not on the request (`DecodeTable`: per page-table row)."""

    def computed_tokens(self, row: int) -> int:
        """The computed count of the request holding `row`."""


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)  # (a request is itself: `in` and `remove` on the queues compare identities)
class Request:
    request_id: str
    prompt: ProcessedPrompt
    sampling_params: SamplingParams
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens] int64, CPU
    mrope_delta: int
    eos_token_ids: list[int]
    generator: Optional[Any] = None  # a seeded request's `runner.make_generator(seed)`: torch.Generator, or RankGenerator (TP)
    grammar: Optional[Any] = None  # GrammarState of a structured-output request, or a ReasoningGate in front of one
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Async scheduling: launched steps of this request not collected yet (0 when synchronous, between
    # steps), the tokens they sample that the host does not have yet (0 or 1), and the drafts they verify
    # (how many are accepted is known when the step is collected)
    num_launched_steps: int = 0
    num_pending_tokens: int = 0
    num_launched_drafts: int = 0
    # `num_computed_tokens` (the property below) while no decode table keeps it: tokens scheduled so far, KV in
    # the cache or being computed by a launched step (async: an uncollected step's tokens; spec decode: its
    # drafts, until rejected ones are taken back)
    own_computed_tokens: int = 0
    # the scheduler's `DecodeTable` while it keeps this request's computed count (a known plain decode row: the
    # count moves with the table's columns, no write per request per step); None: `own_computed_tokens`
    computed_in: Optional[ComputedTokens] = field(default=None, repr=False)
    req_pool_idx: Optional[int] = None  # row in ReqToTokenPool while running
    pages: list[int] = field(default_factory=list)  # KV pages held (owned or shared via the prefix cache), in token order
    # Prefix cache: chained keys of the prompt's full pages (empty when caching is off), how many of
    # this request's pages are indexed, and the tokens the last admission reused.
    page_keys: list[bytes] = field(default_factory=list)
    num_indexed_pages: int = 0
    prefix_hit_tokens: int = 0
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    first_token_time: Optional[float] = None
    scheduled_time: Optional[float] = None  # time.monotonic() when first scheduled (the end of its queue time)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # per prompt position, when asked
    spec_decode: Optional[SpecDecodeStats] = None  # speculative decoding's counters (None: the engine does not speculate)
    speculates: bool = True  # may get drafts (False: added above speculative_config's disable_by_batch_size)
    lora: Optional[LoRARequest] = None  # the LoRA adapter it runs with (None: the base model)
    priority: int = 0  # the priority scheduling policy serves lower values first (engine/queue_policy.py)
    pooling: Optional[PoolingState] = None  # a pooling (embedding) request: prefill-only, pooled (vlmrun/pooling/)
    # its decodes go in a step's `DecodeRows` (no grammar, drafts nor `min_tokens`;
    # set by the scheduler), sampled with `sampling_row`, made once
    plain_decode: bool = False
    sampling_row: Optional[SamplingRow] = None
    # async scheduling: a plain decode with a launched step runs on (a placeholder for its pending token)
    # while its num_tokens is below this; at it the request waits (`Scheduler.must_wait`: its sampling reads
    # the ids, or max_tokens / max_model_len end it there). Set with `plain_decode`; 0: it always waits.
    decode_wait_tokens: int = 0
    num_prompt_tokens: int = field(init=False, default=0)  # len(prompt.token_ids), set once

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt.token_ids

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt.token_ids)  # read on every step: a plain attribute

    @property
    def num_computed_tokens(self) -> int:
        table = self.computed_in
        return self.own_computed_tokens if table is None else table.computed_tokens(self.req_pool_idx)

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        """Set here, the count is the request's own again (a table that kept it keeps it no longer)."""
        self.own_computed_tokens, self.computed_in = n, None

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, counting those still on the device (async scheduling)."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    def mark_launched(self, end: int, samples: bool, num_drafts: int) -> None:
        """A launched step computes the request up to `end` (its drafts included), sampling or not."""
        if self.scheduled_time is None:
            self.scheduled_time = time.monotonic()
        self.num_computed_tokens = end
        self.num_launched_steps += 1
        self.num_pending_tokens += samples
        self.num_launched_drafts += num_drafts

    def mark_collected(self, sampled: bool, num_drafts: int) -> None:
        """The host read a launched step of the request (`Scheduler.settle` takes back rejected drafts)."""
        self.num_launched_steps -= 1
        self.num_pending_tokens -= sampled
        self.num_launched_drafts -= num_drafts

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end); a token still on the device is PLACEHOLDER_TOKEN (the runner reads it there)."""
        prompt = self.prompt.token_ids
        if end <= len(prompt):
            return prompt[start:end]
        out_start = max(start - len(prompt), 0)
        known = prompt[start:] + self.output_token_ids[out_start:end - len(prompt)]
        return known + [PLACEHOLDER_TOKEN] * (end - start - len(known))

    def sampling_outputs(self) -> list[int]:
        """The output ids as the sampler sees them: a placeholder for each still on the device, so that
        `min_tokens` counts it (rows that read the ids themselves wait for them: `Scheduler.must_wait`)."""
        if not self.num_pending_tokens:
            return self.output_token_ids
        return self.output_token_ids + [PLACEHOLDER_TOKEN] * self.num_pending_tokens

    def positions_slice(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start]: precomputed for the prompt, `i + delta` after it."""
        n_prompt = self.num_prompt_tokens
        parts = []
        if start < n_prompt:
            parts.append(self.mrope_positions[:, start:min(end, n_prompt)])
        if end > n_prompt:
            gen = torch.arange(max(start, n_prompt), end, dtype=torch.int64) + self.mrope_delta
            parts.append(gen.expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @property
    def sampling_grammar(self) -> Optional[Any]:
        """The grammar that masks this step's logits: None while there is none or it is idle (free reasoning)."""
        grammar = self.grammar
        return grammar if grammar is not None and grammar.constraining else None

    def advance_grammar(self, token_id: int) -> Optional[str]:
        """Feed an appended token to the request's grammar; "stop" once the grammar has ended."""
        if self.grammar is None:
            return None
        if not self.grammar.accept(token_id):  # the mask forbids this; a stop string or bug could not
            logger.warning("request %s: token %d breaks its grammar; finishing it", self.request_id, token_id)
            return "stop"
        return "stop" if self.grammar.is_terminated else None
