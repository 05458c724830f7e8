"""Decides who runs each step: continuous batching, chunked prefill, preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, oldest
first: a decode costs one token, an unfinished prefill takes as much of its remaining prompt as
the budget allows. Waiting requests are then admitted, oldest first, up to `max_num_seqs`. With LoRA, a request
whose adapter finds no free slot among the `max_loras` (all held by adapters running requests use)
is skipped, and so is every adapter's request behind it, while base-model requests behind it are
admitted: no head-of-line blocking, and no later adapter request keeps the slots from it (it gets
the first slot that frees).
When the KV pool has no page for a running request, the newest running request is preempted:
its pages are freed and it waits to recompute its prompt and the tokens it already generated.
The queue policy (`queue_policy.py`, `EngineConfig.scheduling_policy`) orders both queues: "fcfs" as
above; "priority" by (priority, arrival), lower first, preempting the lowest-ranked running request,
also to admit a waiting request ranked before it that finds no pages.

The scheduler is the only writer of the caches' bookkeeping: for every chunk it picks it writes
the page table (`ReqToTokenPool`) rows of the tokens the chunk feeds and zeroes the GDN slot of a
request that starts from its first token; the model runner only reads them.

With a prefix cache (docs/prefix_cache.md), an admitted request first takes the longest run of
cached full prompt pages (always leaving at least one token to compute) and starts its first
chunk there; for a hybrid model the run ends at a page that has a GDN state snapshot, which is
copied into the request's slot. After each step `commit` indexes the request's newly computed
full prompt pages and, for hybrid models, snapshots the GDN state when a chunk ends at a
snapshot point (the scheduler cuts prefill chunks so that they do). These rules are
`prefix_reuse.PrefixReuse` (`Scheduler.prefix`).

Speculative decoding (docs/spec_decode.md): a decoding request may feed draft tokens after its last
known token (`ScheduledChunk.draft_token_ids`, from the proposer, within the step's budget and the
request's length limits); pages for them are taken only when free (drafts never preempt). After the
step, `settle` counts as computed only the accepted positions: the KV the rejected drafts wrote stays
in the request's pages, past its length, until later tokens overwrite it, and is never indexed (prompt
pages only). Async scheduling: a request waits for its launched verify step (`must_wait`). A request
added while more than `disable_by_batch_size` requests are enqueued never speculates (`add`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Union

import numpy as np
import torch

from vlmrun.cache.gdn_pool import gdn_slot_for_row
from vlmrun.cache.kv_pool import pages_needed
from vlmrun.cache.plan import Caches
from vlmrun.cache.prefix_cache import PrefixCache
from vlmrun.engine.decode_columns import NEVER_WAITS, DecodeTable, UnusedDecodeTable, decode_wait_tokens
from vlmrun.engine.prefix_reuse import PrefixReuse
from vlmrun.engine.queue_policy import make_queue_policy
from vlmrun.engine.request import Request, RequestStatus
from vlmrun.engine.scheduled_chunk import ScheduledChunk, ScheduledDecodes
from vlmrun.engine.token_map import map_tokens
from vlmrun.executor.step_input import PLACEHOLDER_TOKEN
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.spec_decode.metrics import SpecDecodeStats
from vlmrun.spec_decode.proposer import Proposer


class Scheduler:
    def __init__(self, caches: Caches, max_num_batched_tokens: int, prefix_cache: Optional[PrefixCache] = None,
                 snapshot_interval: int = 512, proposer: Optional[Proposer] = None, max_loras: Optional[int] = None,
                 disable_by_batch_size: Optional[int] = None, scheduling_policy: str = "fcfs",
                 decode_rows: bool = False, overlaps_steps: bool = True):
        self.allocator = caches.allocator
        self.req_pool = caches.req_to_token
        self.gdn_pool = caches.gdn_pool
        self.page_size = caches.allocator.page_size
        self.max_num_seqs = caches.plan.max_num_seqs
        self.max_model_len = caches.plan.max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.policy = make_queue_policy(scheduling_policy)  # the queues' order and who preempts whom
        self.prefix_cache = prefix_cache
        self.prefix = PrefixReuse(prefix_cache, self.page_size, snapshot_interval)  # (no cache: no-ops)
        self.proposer = proposer  # speculative decoding's drafts; None: every decode feeds one token
        # a request added while more than this many are enqueued never speculates (None: no limit)
        self.disable_by_batch_size = disable_by_batch_size
        self.max_loras = max_loras  # LoRA: distinct adapters the running requests may use (None: LoRA off)
        # plain decodes go in the step's `ScheduledDecodes` columns (the runner takes `DecodeRows`; not
        # with speculative decoding, whose rows are verified as chunks)
        self.decode_rows = decode_rows and proposer is None
        self.overlaps_steps = overlaps_steps  # async scheduling: a request may have a launched step (must_wait)
        # what each page-table row's request carries from one plain decode step to the next (its pages...)
        self.decode_table: Union[DecodeTable, UnusedDecodeTable] = UnusedDecodeTable()
        if self.decode_rows:
            self.decode_table = DecodeTable(self.req_pool.max_reqs, pages_needed(self.max_model_len, self.page_size) + 1,
                                            self.page_size)
        # speculative decoding's counters over every request (None: the engine does not speculate)
        self.spec_decode = (None if proposer is None
                            else SpecDecodeStats(num_accepted_tokens_per_pos=[0] * proposer.k))

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_usable_pages() * self.page_size

    def add(self, req: Request) -> None:
        """Queue a new request; with speculative decoding, it speculates unless more than
        `disable_by_batch_size` requests are enqueued (running + waiting) already."""
        if self.proposer is not None:
            req.spec_decode = SpecDecodeStats()
            limit = self.disable_by_batch_size
            req.speculates = limit is None or len(self.running) + len(self.waiting) <= limit
        # (penalties, bad words, a bias, allowed ids: the runner's SamplingState keeps them per row; not
        # min_tokens, which counts the outputs still on the device, `Request.sampling_outputs`)
        if self.decode_rows and req.grammar is None and not req.sampling_params.min_tokens:
            req.plain_decode = True
            req.sampling_row = SamplingRow(req.sampling_params, req.prompt_token_ids, req.output_token_ids,
                                           req.generator, req.eos_token_ids)
            # (synchronous: no launched step when the scheduler runs, so `must_wait` never holds: no token count)
            req.decode_wait_tokens = (decode_wait_tokens(req, self.max_model_len) if self.overlaps_steps
                                      else NEVER_WAITS)
        self.policy.enqueue(self.waiting, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[ScheduledChunk], ScheduledDecodes, list[Request]]:
        """Chunks to run this step, its plain decodes (they run first), and requests that can never fit
        (to be finished by the engine).

        The page table rows and KV slots are written, and fresh GDN slots zeroed, on return."""
        decodes = ScheduledDecodes()
        chunks, too_long = self._pick_chunks(decodes)
        map_tokens(chunks, decodes, self.page_size, self.req_pool)
        self._zero_fresh_gdn_slots(chunks)
        return chunks, decodes, too_long

    def _pick_chunks(self, decodes: ScheduledDecodes) -> tuple[list[ScheduledChunk], list[Request]]:
        """The running requests in order, then admissions. A plain decode (`Request.plain_decode`) goes in
        `decodes` until the first request that runs as a chunk: the decodes run first in the step, so the
        rows keep this order."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        too_long: list[Request] = []
        preempted_any = False
        self.policy.order_running(self.running)  # the last is the one preempted first
        i, budget = self._pick_decodes(decodes, budget)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_launched_steps and self.must_wait(req):
                i += 1
                continue
            n = self.prefix.cut(req, min(req.num_tokens - req.num_computed_tokens, budget))
            drafts = self._drafts(req, n, budget) if self.proposer is not None else []
            if drafts and not self._grow(req, req.num_computed_tokens + n + len(drafts)):
                drafts = []  # no free page for them: a plain decode (drafts never preempt)
            if not self._grow_or_preempt(req, req.num_computed_tokens + n):
                if len(self.running) == 1 and req.num_launched_steps:  # too long? decided with all its tokens known
                    preempted_any = True  # (and no admissions this step: it may need every free page)
                    break
                if len(self.running) == 1:  # alone and still no room: the pool is too small for it
                    self.running.remove(req)
                    too_long.append(req)
                else:
                    self._preempt(req)
                preempted_any = True
                break
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n + len(drafts), draft_token_ids=drafts))
            budget -= n + len(drafts)
            i += 1
        if preempted_any:
            return chunks, too_long

        waits_for_lora = False  # a request ahead waits for an adapter slot: adapters' requests wait behind it
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_launched_steps:  # preempted while a launched step runs it: recompute once that is collected
                break
            if req.lora is not None and (waits_for_lora or not self._lora_fits(req)):
                waits_for_lora = True  # every slot is held by an adapter running requests use
                i += 1
                continue
            row = self.req_pool.alloc()
            if row is None:
                break
            match = self.prefix.take(req, row)
            n = self.prefix.cut(req, min(req.num_tokens - req.num_computed_tokens, budget))
            fits = self._grow(req, req.num_computed_tokens + n)
            while not fits and (victim := self.policy.admission_victim(self.running, req)) is not None:
                budget += self._preempt_scheduled(victim, chunks, decodes)  # (priority: one ranked after `req`)
                fits = self._grow(req, req.num_computed_tokens + n)
            if not fits:
                self._release(req)
                self.req_pool.free(row)
                req.num_computed_tokens = req.num_indexed_pages = req.prefix_hit_tokens = 0
                break
            if match is not None:
                self.prefix.count_lookup(req, match.num_pages)
            del self.waiting[i]
            req.req_pool_idx = row
            self.decode_table.admit(req, row)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, admitted=True))
            budget -= n
        return chunks, too_long

    def _pick_decodes(self, decodes: ScheduledDecodes, budget: int) -> tuple[int, int]:
        """The leading run of running requests that decode plainly (`Request.plain_decode`, past its prompt,
        feeding its last token), each a row of `decodes` with its KV slot. From `DecodeTable.fast_from`
        running requests the runs the table says decode with no rule to apply (`fast`) are taken whole, and
        the rules applied one request at a time to the others only (one that must wait, or whose next token
        opens a page, or a first decode); below it, to every request. -> (where the run ends, budget left)"""
        running, table = self.running, self.decode_table
        if not self.decode_rows or not running:
            return 0, budget
        decodes.table = table
        if len(running) < table.fast_from:  # (the table's numpy costs more than a few requests' rules)
            i, budget, _ = self._pick_by_rules(decodes, budget, 0, len(running))
            return i, budget
        table.forget_all_if_stale()
        rows = table.rows_of(running)  # [n]
        fast = table.fast(rows)
        slow: list[int] = []
        if not fast.all():
            table.open_pages(running, rows, fast, budget, self.allocator)  # (1 in `page_size` steps)
            slow = np.flatnonzero(~fast).tolist()
        i = k = 0
        while i < len(running) and budget > 0:
            end = min(slow[k] if k < len(slow) else len(running), len(running), i + budget)
            if end > i:
                decodes.add_run(running, i, end, rows, table)
                budget, i = budget - (end - i), end
                continue
            k += 1  # (newer requests preempted for its page: past i, `rows` holds for the rest)
            i, budget, ended = self._pick_by_rules(decodes, budget, i, i + 1)
            if ended:
                break
        decodes.close_columns()
        return i, budget

    def _pick_by_rules(self, decodes: ScheduledDecodes, budget: int, i: int, stop: int) -> tuple[int, int, bool]:
        """Rows of `running[i:stop]` by the rules, one request at a time, as host ints: a request that must
        wait is skipped, the first that does not decode plainly ends the run. -> (i, budget, ended)"""
        running, page_size = self.running, self.page_size
        add_request, add_row, add_start, add_token, add_slot = decodes.column_appends()
        while i < stop and i < len(running) and budget > 0:
            req = running[i]
            if req.num_launched_steps and self.must_wait(req):
                i += 1
                continue
            # (the count read without a call when it is the request's own, as for rows the table does not know)
            start = req.own_computed_tokens if req.computed_in is None else req.num_computed_tokens
            pending, outputs = req.num_pending_tokens, req.output_token_ids
            if not (req.plain_decode and start >= req.num_prompt_tokens  # (num_tokens - 1, inline: no call)
                    and start == req.num_prompt_tokens + len(outputs) + pending - 1
                    and (start < len(req.pages) * page_size or self._grow_or_preempt(req, start + 1))):
                return i, budget, True
            add_request(req)  # (the columns appended here: once per row, no call)
            add_row(req.req_pool_idx)
            add_start(start)
            add_token(outputs[-1] if not pending else PLACEHOLDER_TOKEN)
            add_slot(req.pages[start // page_size] * page_size + start % page_size)
            budget, i = budget - 1, i + 1
        return i, budget, False

    def _lora_fits(self, req: Request) -> bool:
        """LoRA: the running requests' adapters and `req`'s fit the `max_loras` slots of a step."""
        if req.lora is None or self.max_loras is None:
            return True
        running = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return req.lora.lora_int_id in running or len(running) < self.max_loras

    def must_wait(self, req: Request) -> bool:
        """Async scheduling: a request whose last token is still on the device (a launched step samples
        it) runs on with a placeholder for it, unless its next step needs that token on the host: its
        grammar must accept it before the next mask; its penalties or bad words read it; it ends the
        request by length; n-gram drafts are looked up from it. It waits for a launched verify step
        (where its next tokens go depends on how many drafts were accepted), and for a chunk that ended at
        a GDN snapshot point (the snapshot is taken at collect: the slot must not move on before)."""
        if not req.num_launched_steps:  # nothing of it is running (always so when synchronous)
            return False
        if req.num_launched_drafts or self.prefix.ends_at_snapshot_point(req):
            return True
        if req.pooling is not None:  # prefill-only: once its whole prompt is launched it waits only to finish
            return req.num_computed_tokens >= req.num_prompt_tokens
        if not req.num_pending_tokens:  # a prompt chunk is running: the next one follows it
            return False
        params, proposer = req.sampling_params, self.proposer
        return bool(req.grammar is not None or params.reads_output_tokens
                or (proposer and req.speculates and not proposer.drafts_on_device)
                or (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens)
                or req.num_tokens >= self.max_model_len)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Draft tokens for a decoding request (`n` = 1: its last token) to verify this step: within the
        budget, and short enough that the run they can add keeps within max_tokens and max_model_len.
        None, when the drafts are made on the device, for a request whose sampling reads its output ids
        (penalties, bad words). A structured-output request gets them too (its verify positions are masked
        by its grammar after the drafts before them, `vlmrun/spec_decode/grammar.py`), unless the proposer
        cannot bring its drafts to the matcher (MTP under tensor parallelism)."""
        if (self.proposer is None or not req.speculates or n != 1 or not req.num_output_tokens
                or req.num_computed_tokens != req.num_tokens - 1
                or (self.proposer.drafts_on_device and req.sampling_params.reads_output_tokens)
                or (req.grammar is not None and not self.proposer.drafts_grammar_rows)):
            return []
        limit = min(budget - 1, self.max_model_len - req.num_tokens - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - req.num_output_tokens - 1)
        # (keyed: the n-gram proposer extends its index of the request's tokens by the new ones only)
        return self.proposer.propose(req.prompt_token_ids + req.output_token_ids, limit, key=req.request_id)

    def settle(self, chunk: ScheduledChunk, num_accepted: int) -> int:
        """After `chunk`'s step `num_accepted` of its drafts were accepted; the rejected ones no longer count
        as computed (their KV slots are overwritten later). Returns the computed end."""
        if not chunk.draft_token_ids:
            return chunk.end
        req = chunk.request
        if req.status is RequestStatus.RUNNING:  # (preempted while the step ran: it recomputes from 0)
            req.num_computed_tokens = chunk.end - (len(chunk.draft_token_ids) - num_accepted)
        for stats in (req.spec_decode, self.spec_decode):
            if stats is not None:
                stats.record(len(chunk.draft_token_ids), num_accepted)
        return req.num_computed_tokens

    # ------------------------------------------------------------------ cache bookkeeping

    def _zero_fresh_gdn_slots(self, chunks: list[ScheduledChunk]) -> None:
        """A request computing from its first token (new, or recomputing after a preemption) starts
        from zero GDN state; one resuming a prefix-cache hit had its snapshot restored at admission."""
        fresh = [gdn_slot_for_row(c.request.req_pool_idx) for c in chunks if c.start == 0]
        if self.gdn_pool is not None and fresh:
            self.gdn_pool.zero(torch.tensor(fresh, dtype=torch.int64))

    # ------------------------------------------------------------------ pages

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        if req.req_pool_idx is not None:  # (admission writes the row's pages once it has one)
            self.decode_table.grow(req.req_pool_idx, len(req.pages), pages)
        req.pages.extend(pages)
        return True

    def _grow_or_preempt(self, req: Request, num_tokens: int) -> bool:
        """Give `req` room for `num_tokens`, preempting newer running requests as needed."""
        if num_tokens <= len(req.pages) * self.page_size:  # the pages it holds have room
            return True
        while not self._grow(req, num_tokens):
            victim = self.running[-1]
            if victim is req:
                return False
            self._preempt(victim)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = req.num_indexed_pages = req.prefix_hit_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(self.waiting, req)

    def _preempt_scheduled(self, req: Request, chunks: list[ScheduledChunk], decodes: ScheduledDecodes) -> int:
        """Preempt running `req` for a waiting request ranked before it, dropping its chunk or decode row
        of this step if it has one; returns the tokens of budget that gives back."""
        chunk = next((c for c in chunks if c.request is req), None)
        if chunk is not None:
            chunks.remove(chunk)
        freed = 1 if decodes.remove(req) else 0 if chunk is None else chunk.num_tokens
        self._preempt(req)
        return freed

    def _release(self, req: Request) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            self.decode_table.release(req.req_pool_idx)
            req.req_pool_idx = None

    def finish(self, req: Request) -> None:
        """Drop a request from the queues and free its KV pages and row."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
