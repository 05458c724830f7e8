"""`ScheduledChunk`: one request's part of a step, as the scheduler picked it, and what the model runner
gets of it (`to_input`: a `ChunkInput`). `ScheduledDecodes`: the step's plain decodes (a request past its
prompt feeding its last known token, `Request.plain_decode`) as columns, one append per request and no
object (the runner gets them as one `DecodeRows`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from vlmrun.engine.request import Request
from vlmrun.executor.step_input import PLACEHOLDER_TOKEN, ChunkInput, DecodeRows, PromptLogprobTargets
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.spec_decode.grammar import DraftGrammar


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # tokens already in the cache
    num_tokens: int  # tokens fed this step (draft tokens included)
    admitted: bool = False  # the request joined the running set this step (its page table row is new)
    kv_slots: Optional[torch.Tensor] = None  # [num_tokens] int64 KV slots of the fed tokens, set by the scheduler
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding: fed after the last known token

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def known_end(self) -> int:
        """The end of the fed tokens the request has (the drafts come after it)."""
        return self.end - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so its logits give the next token."""
        return self.known_end == self.request.num_tokens

    def to_input(self) -> ChunkInput:
        """What the model runner needs of this chunk (a decode of a request past its prompt: no tensor made)."""
        req = self.request
        drafts = self.draft_token_ids
        end = self.start + self.num_tokens
        known_end = end - len(drafts)
        samples = known_end == req.num_tokens
        in_prompt = self.start < req.num_prompt_tokens
        sampling = (SamplingRow(req.sampling_params, req.prompt_token_ids, req.sampling_outputs(), req.generator,
                                req.eos_token_ids, req.sampling_grammar) if samples and req.pooling is None else None)
        if known_end - self.start == 1 and not in_prompt:  # a decode: the last output token (or its placeholder)
            outputs, at = req.output_token_ids, self.start - req.num_prompt_tokens
            token_ids = [outputs[at] if at < len(outputs) else PLACEHOLDER_TOKEN]
        else:
            token_ids = req.token_ids_slice(self.start, known_end)
        if drafts:
            token_ids = token_ids + drafts
        draft_grammar = DraftGrammar(req.grammar) if drafts and req.grammar is not None else None
        return ChunkInput(row=req.req_pool_idx, start=self.start, token_ids=token_ids,
                          positions=req.positions_slice(self.start, end) if in_prompt else None,
                          mrope_delta=req.mrope_delta, kv_slots=self.kv_slots,
                          mm_items=req.prompt.mm_items if in_prompt else (), sampling=sampling,
                          prompt_logprobs=self.prompt_logprob_targets() if in_prompt else None,
                          num_drafts=len(drafts), draft_grammar=draft_grammar,
                          next_token_id=None if samples else req.token_ids_slice(end, end + 1)[0],
                          lora=req.lora, feeds_drafter=self.feeds_drafter,
                          pooling=None if req.pooling is None else req.pooling.chunk(self.start, end, req.num_prompt_tokens))

    @property
    def feeds_drafter(self) -> bool:
        """MTP catches up over the chunk: its request speculates, or the chunk feeds prompt pages the prefix
        cache may give a request that does (their MTP KV must be there)."""
        return self.request.speculates or bool(self.request.page_keys and self.start < self.request.num_prompt_tokens)

    def prompt_logprob_targets(self) -> Optional[PromptLogprobTargets]:
        """For a request with prompt logprobs: the prompt token after each fed token that has one."""
        req, k = self.request, self.request.sampling_params.prompt_logprobs
        last = min(self.end, req.num_prompt_tokens - 1)  # fed positions start .. last - 1 are followed by a prompt token
        if k is None or self.start >= last:
            return None
        return PromptLogprobTargets(k, req.prompt_token_ids[self.start + 1:last + 1])


@dataclass
class ScheduledDecodes:
    """A step's plain decodes, a column per field: request i feeds its last known token, at position
    starts[i], into KV slot slots[i] of page-table row rows[i], and samples after it. The scheduler
    appends the rows (`Scheduler._pick_decodes`, in one loop over its running requests)."""

    requests: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # PLACEHOLDER_TOKEN: still on the device
    slots: list[int] = field(default_factory=list)
    kv_slots: Optional[torch.Tensor] = None  # [n] int64 `slots` as a tensor, set by the scheduler's one copy

    def __len__(self) -> int:
        return len(self.requests)

    def column_appends(self) -> tuple[Callable[[Any], None], ...]:
        """The `append` of each column (requests, rows, starts, token_ids, slots), for a loop that adds rows."""
        return (self.requests.append, self.rows.append, self.starts.append, self.token_ids.append,
                self.slots.append)

    def remove(self, req: Request) -> bool:
        """Drop `req`'s row (preempted after it was picked); False when it has none."""
        for i, picked in enumerate(self.requests):
            if picked is req:
                for column in (self.requests, self.rows, self.starts, self.token_ids, self.slots):
                    del column[i]
                return True
        return False

    def mark_launched(self) -> None:
        """Each row's request is launched one token on (`Request.mark_launched(start + 1, True, 0)`, inline:
        once per row; a decoding request was scheduled before)."""
        for req, start in zip(self.requests, self.starts):
            req.num_computed_tokens = start + 1
            req.num_launched_steps += 1
            req.num_pending_tokens += 1

    def mark_collected(self, now: float) -> None:
        """The host read the step (`Request.mark_collected(True, 0)`, inline); a request without a first
        token time gets `now`."""
        for req in self.requests:
            req.num_launched_steps -= 1
            req.num_pending_tokens -= 1
            if req.first_token_time is None:
                req.first_token_time = now

    def to_input(self) -> DecodeRows:
        """What the model runner needs of them: the columns, each request's sampling row and adapter (the
        runner keeps each row's M-RoPE delta from the request's chunks)."""
        requests = self.requests
        return DecodeRows(rows=self.rows, starts=self.starts, token_ids=self.token_ids, kv_slots=self.kv_slots,
                          sampling=[r.sampling_row for r in requests], loras=[r.lora for r in requests])
