"""`ScheduledChunk`: one request's part of a step, as the scheduler picked it, and what the model runner
gets of it (`to_input`: a `ChunkInput`). `ScheduledDecodes`: the step's plain decodes (a request past its
prompt feeding its last known token, `Request.plain_decode`) as columns, no object per request (the
runner gets them as one `DecodeRows`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, Optional

import numpy as np
import torch

from vlmrun.engine.decode_columns import DecodeTable
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


_FIRST_TOKEN_TIME = attrgetter("first_token_time")


@dataclass
class ScheduledDecodes:
    """A step's plain decodes, a column per field: request i feeds its last known token, at position
    starts[i], into KV slot slots[i] of page-table row rows[i], and samples after it. The scheduler
    adds the rows (`Scheduler._pick_decodes`): runs of them from its `DecodeTable` (`add_run`, numpy
    columns), which they update when launched and collected, and rows picked by the rules one at a time
    (`column_appends`, host ints)."""

    requests: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # PLACEHOLDER_TOKEN: still on the device
    slots: list[int] = field(default_factory=list)
    kv_slots: Optional[torch.Tensor] = None  # [n] int64 `slots` as a tensor, set by the scheduler's one copy
    table: Optional[DecodeTable] = None  # the scheduler's per-row state the rows came from
    # [n] int64 `rows`, `starts`, `slots` as numpy arrays (the same values); None: made as host ints (a few rows)
    row_array: Optional[np.ndarray] = None
    start_array: Optional[np.ndarray] = None
    slot_array: Optional[np.ndarray] = None
    launch: int = 0  # the table's number of their launch
    all_known: bool = False  # every row was `DecodeTable.fast`: collected as a decode row before (a first token time)
    overlapped: bool = True  # launched with async scheduling: the requests' launched counters count it
    counted_by_table: bool = False  # launched through `table`, which keeps the rows' computed counts

    def __len__(self) -> int:
        return len(self.requests)

    def column_appends(self) -> tuple[Callable[[Any], None], ...]:
        """The `append` of each column (requests, rows, starts, token_ids, slots), for a loop that adds rows
        one at a time (`Scheduler._pick_by_rules`)."""
        return (self.requests.append, self.rows.append, self.starts.append, self.token_ids.append,
                self.slots.append)

    def add_run(self, running: list[Request], a: int, b: int, rows: np.ndarray, table: DecodeTable) -> None:
        """The rows of `running[a:b]`, each `table.fast` (its page-table row in `rows` [len(running)]): at its
        table start + 1, fed its last output or, while the step that sampled it runs, a placeholder. The
        columns with numpy; the first rows of the step keep them as arrays (the common case: one run)."""
        row_array = rows[a:b]
        starts = table.start[row_array] + 1
        slots = table.slots(row_array, starts)
        requests = running[a:b]
        pending = table.in_flight[row_array]
        num_pending = np.count_nonzero(pending)
        if num_pending == len(requests):
            token_ids = [PLACEHOLDER_TOKEN] * len(requests)
        elif not num_pending:  # (synchronous: every last token is on the host, the one its last step sampled)
            token_ids = table.last_token[row_array].tolist()
        else:
            token_ids = np.where(pending, PLACEHOLDER_TOKEN, table.last_token[row_array]).tolist()
        if not self.requests:
            self.requests, self.token_ids = requests, token_ids
            self.rows, self.starts, self.slots = row_array.tolist(), starts.tolist(), slots.tolist()
            self.row_array, self.start_array, self.slot_array = row_array, starts, slots
            self.all_known = True
            return
        self.requests += requests
        self.token_ids += token_ids
        self.rows += row_array.tolist()
        self.starts += starts.tolist()
        self.slots += slots.tolist()
        self.row_array = None
        self.all_known = False

    def close_columns(self) -> None:
        """The step's rows are all picked (through the table): the columns as numpy arrays too."""
        if self.requests and (self.row_array is None or len(self.row_array) != len(self.rows)):
            self.row_array, self.start_array, self.slot_array = (
                np.array(column, dtype=np.int64) for column in (self.rows, self.starts, self.slots))
            self.all_known = False

    def remove(self, req: Request) -> bool:
        """Drop `req`'s row (preempted after it was picked); False when it has none."""
        for i, picked in enumerate(self.requests):
            if picked is req:
                for column in (self.requests, self.rows, self.starts, self.token_ids, self.slots):
                    del column[i]
                if self.row_array is not None:
                    self.row_array, self.start_array, self.slot_array = (
                        np.delete(a, i) for a in (self.row_array, self.start_array, self.slot_array))
                return True
        return False

    def host_columns(self) -> tuple[Any, Any, Any]:
        """rows, starts, slots: the numpy arrays, or the lists when the rows were made as host ints."""
        if self.row_array is None:
            return self.rows, self.starts, self.slots
        return self.row_array, self.start_array, self.slot_array

    def mark_launched(self, overlapped: bool = True) -> None:
        """Each row's request is launched one token on (`Request.mark_launched(start + 1, True, 0)`, inline:
        a decoding request was scheduled before), and the table knows it: rows picked through the table have
        their computed count kept there from now (`DecodeTable.launched`), no write per request. Synchronous
        (`overlapped` False): the step is collected before anything reads the requests again, so their
        launched and pending counters, which would go +1 and back within the step, are left as they are, and
        the computed count of rows picked by the rules is written at collect (`mark_collected`)."""
        self.overlapped = overlapped
        self.counted_by_table = self.table is not None and self.row_array is not None and bool(self.requests)
        if overlapped:
            if not self.counted_by_table:
                self._set_computed()
            for req in self.requests:
                req.num_launched_steps += 1
                req.num_pending_tokens += 1
        if self.table is None or not self.requests:
            return
        if self.row_array is None:  # (a few rows, picked by the rules: the table keeps nothing of them)
            self.table.stale = True
        else:
            self.launch = self.table.launched(self.row_array, self.start_array, self.all_known, self.requests)

    def mark_collected(self, now: float, token_ids: list[int]) -> None:
        """The host read the step, which sampled `token_ids` [n] (`Request.mark_collected(True, 0)`, inline;
        the output processor appends the tokens next); a request without a first token time gets `now`."""
        requests = self.requests
        if self.overlapped:
            for req in requests:
                req.num_launched_steps -= 1
                req.num_pending_tokens -= 1
        elif not self.counted_by_table:
            self._set_computed()
        if not self.all_known and None in map(_FIRST_TOKEN_TIME, requests):
            for req in requests:
                if req.first_token_time is None:
                    req.first_token_time = now
        if self.table is not None and self.row_array is not None:
            self.table.collected(self.row_array, self.launch, token_ids)

    def _set_computed(self) -> None:
        """Each row's `Request.num_computed_tokens` = its start + 1, its own (two `map`s, no Python frame per row:
        the property's setter, inline)."""
        ends = [start + 1 for start in self.starts] if self.start_array is None else (self.start_array + 1).tolist()
        deque(map(setattr, self.requests, repeat("own_computed_tokens"), ends), maxlen=0)
        deque(map(setattr, self.requests, repeat("computed_in"), repeat(None)), maxlen=0)

    def to_input(self) -> DecodeRows:
        """What the model runner needs of them: the columns, each row's sampling row and adapter (kept per
        page-table row by the table; the runner keeps each row's M-RoPE delta from the request's chunks)."""
        sampling, loras = self.table.columns_of(self.rows)
        return DecodeRows(rows=self.rows, starts=self.starts, token_ids=self.token_ids, kv_slots=self.kv_slots,
                          sampling=sampling, loras=loras)
