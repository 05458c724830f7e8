"""Decides who runs each step: continuous batching, chunked prefill, preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, oldest
first: a decode costs one token, an unfinished prefill takes as much of its remaining prompt as
the budget allows. Waiting requests are then admitted, oldest first, up to `max_num_seqs`.
When the KV pool has no page for a running request, the newest running request is preempted:
its pages are freed and it waits to recompute its prompt and the tokens it already generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vlmrun.cache.kv_pool import PageAllocator, ReqToTokenPool, pages_needed
from vlmrun.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # tokens already in the cache
    num_tokens: int  # tokens fed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so its logits give the next token."""
        return self.end == self.request.num_tokens


class Scheduler:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_usable_pages() * self.page_size

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[ScheduledChunk], list[Request]]:
        """Chunks to run this step, and requests that can never fit (to be finished by the engine)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        too_long: list[Request] = []
        preempted_any = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow_or_preempt(req, req.num_computed_tokens + n):
                if len(self.running) == 1:  # alone and still no room: the pool is too small for it
                    self.running.remove(req)
                    too_long.append(req)
                else:
                    self._preempt(req)
                preempted_any = True
                break
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        if preempted_any:
            return chunks, too_long

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            row = self.req_pool.alloc()
            if row is None:
                break
            if not self._grow(req, req.num_computed_tokens + n):
                self.req_pool.free(row)
                break
            self.waiting.popleft()
            req.req_pool_idx = row
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return chunks, too_long

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _grow_or_preempt(self, req: Request, num_tokens: int) -> bool:
        """Give `req` room for `num_tokens`, preempting newer running requests as needed."""
        while not self._grow(req, num_tokens):
            victim = self.running[-1]
            if victim is req:
                return False
            self._preempt(victim)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None

    def finish(self, req: Request) -> None:
        """Drop a request from the queues and free its KV pages and row."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
