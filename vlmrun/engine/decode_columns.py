"""The scheduler's per-row host state for plain decodes (`DecodeTable`): what a running request carries from
one decode step to the next, in preallocated arrays indexed by its page-table row, so that a steady decode
step picks its rows and builds their columns with numpy and no Python per request.

Per row, for the request holding it:

- `pages` [rows, max pages] int32: a mirror of `Request.pages`; `room`: len(pages) * page_size.
- `wait_at`: its `Request.decode_wait_tokens` (`decode_wait_tokens`; 0: never a plain decode).
- `known`, `start`, `in_flight`, `last_token`: its last event was its launch as a plain decode row at position
  `start` (`ScheduledDecodes.mark_launched`), that step not yet collected while `in_flight`, and `last_token`
  the token it sampled once collected (its last output: the output processor appends it). When the scheduler
  reads it, a known request is in the state that launch left: `num_computed_tokens` = start + 1, and
  `num_tokens` = start + 2 (its token appended once collected, or pending on the device before), so its next
  step is a decode at start + 1 unless it must wait or opens a page: `fast` works that out for every running
  row at once, from `limit` (a start below it decodes next at start + 1 with no rule to apply; 0 while not
  known).
- `sampling`, `lora`: its `Request.sampling_row` and adapter (the runner's `DecodeRows` columns).
- `launch`: the number of that launch (each decode launch has the next), so that a step collected after a
  later one launched the row (async scheduling: step N is collected after step N + 1 is launched), or after
  its request left the row (finished or preempted meanwhile), leaves `in_flight` as the later events set it.

Writers, all in the scheduler's one thread: the scheduler (`admit` with a new holder, `release`, `grow`
when it takes pages, `open_pages`), `ScheduledDecodes` (`launched`, `collected`), and the engine's
`_launch`, which `forget`s the request of every chunk it launches (a chunk moves its counters by other
rules). Below `fast_from` running requests the scheduler picks rows by the rules alone and the table
keeps nothing of them (`stale`: every row is forgotten before the table is read again). A known row's
request reads its computed count from here (`Request.num_computed_tokens` through `computed_in`: the launch
moves it for every row at once, no write per request); a request whose row is forgotten or handed over takes
its count back first (`_let_go`). Its other fields stay the truth the rest of the engine reads; for a known row
they agree with the table (tests/test_decode_table.py checks it after random runs).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Optional

import numpy as np

from vlmrun.cache.kv_pool import PageAllocator
from vlmrun.engine.request import Request
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.lora.request import LoRARequest


# running requests from which a step picks its decodes with the table; below, the rules one request at a
# time with host ints cost less than the table's fixed numpy work (even at 56 here: ~46 us a synchronous
# step's scheduling either way; 31 against 40 at 32 requests, 50 against 47 at 64)
FAST_FROM = 56
NEVER_WAITS = 1 << 62  # `decode_wait_tokens` of a request that never waits (a synchronous engine's)


class DecodeTable:
    def __init__(self, num_rows: int, max_pages: int, page_size: int, fast_from: int = FAST_FROM):
        self.page_size = page_size
        self.fast_from = fast_from  # running requests from which `Scheduler._pick_decodes` reads the table
        self.pages = np.zeros((num_rows, max_pages), dtype=np.int32)  # [rows, max pages]
        self.room = np.zeros(num_rows, dtype=np.int64)  # [rows] tokens its pages hold
        self.wait_at = np.zeros(num_rows, dtype=np.int64)
        self.known = np.zeros(num_rows, dtype=bool)
        self.start = np.zeros(num_rows, dtype=np.int64)
        self.limit = np.zeros(num_rows, dtype=np.int64)
        self.in_flight = np.zeros(num_rows, dtype=bool)
        self.last_token = np.zeros(num_rows, dtype=np.int64)
        self.launch = np.zeros(num_rows, dtype=np.int64)
        self.num_launches = 0
        self.sampling: list[Optional[SamplingRow]] = [None] * num_rows
        self.holders: list[Optional[Request]] = [None] * num_rows  # the request holding each row
        self.lora: list[Optional[LoRARequest]] = [None] * num_rows
        self.num_changes = 0  # rows handed out or freed so far (the running rows' cache key)
        self.stale = False  # decode rows were launched without the table (a few, by the rules): nothing is known
        self._running: list[Request] = []  # the running list `rows_of` last saw, and its rows
        self._running_rows = np.zeros(0, dtype=np.int64)
        self._running_key = -1
        self._columns_for: tuple[int, list[int]] = (-1, [])  # (num_changes, rows) `columns_of` last made them for
        self._columns: tuple[list[Optional[SamplingRow]], list[Optional[LoRARequest]]] = ([], [])

    # ------------------------------------------------------------------ the scheduler's writes

    def admit(self, req: Request, row: int) -> None:
        """`req` (its pages taken, a prefix hit's included) holds `row` from now."""
        self._hand_over(row)
        self.holders[row] = req
        self.grow(row, 0, req.pages)
        self.wait_at[row] = req.decode_wait_tokens if req.plain_decode else 0
        self.sampling[row], self.lora[row] = req.sampling_row, req.lora

    def release(self, row: int) -> None:
        self._hand_over(row)
        self.sampling[row] = self.lora[row] = self.holders[row] = None

    def _hand_over(self, row: int) -> None:
        self._let_go([row])
        self.known[row] = self.in_flight[row] = False
        self.limit[row] = 0
        self.num_changes += 1

    def grow(self, row: int, first: int, pages: list[int]) -> None:
        """The row's request holds `pages` from its `first`-th page on."""
        self.pages[row, first:first + len(pages)] = pages
        self.room[row] = (first + len(pages)) * self.page_size
        if self.known[row]:
            self._limit(row)

    def grow_each(self, rows: np.ndarray, pages: list[int]) -> None:
        """Known rows `rows` [m], whose next position opens a page, take one page each (`pages` [m])."""
        self.pages[rows, self.room[rows] // self.page_size] = pages
        self.room[rows] += self.page_size
        self._limit(rows)

    def _limit(self, rows: np.ndarray | int) -> None:
        """`limit` of known rows: start + 1 within the room in their pages and, async scheduling, below
        `wait_at` - 1 (position p is fed with p + 1 tokens; `Scheduler.must_wait` holds from `wait_at` on)."""
        self.limit[rows] = np.minimum(self.room[rows], self.wait_at[rows] - 1) - 1

    def forget(self, rows: list[int]) -> None:
        """The rows' requests move on by other rules than a plain decode row's (chunks were launched)."""
        self._let_go(rows)
        self.known[rows] = False
        self.limit[rows] = 0

    # ------------------------------------------------------------------ a step's decode rows

    def rows_of(self, running: list[Request]) -> np.ndarray:
        """[n] int64 page-table rows of the running requests, in order (kept while no row changes hands
        and the list holds the same requests in the same order)."""
        if self._running_key != self.num_changes or running != self._running:  # (requests compare as identities)
            self._running, self._running_key = list(running), self.num_changes
            self._running_rows = np.fromiter((r.req_pool_idx for r in running), dtype=np.int64, count=len(running))
        return self._running_rows

    def columns_of(self, rows: list[int]) -> tuple[list[Optional[SamplingRow]], list[Optional[LoRARequest]]]:
        """The sampling rows and adapters of page-table `rows` (a step's decode rows, in order): the same lists
        while the rows are the same and no row changed hands, never changed in place (the runner's sampling
        state skips its per-row check for a list it has seen: `SamplingState.gather`)."""
        if self._columns_for[0] != self.num_changes or self._columns_for[1] != rows:
            self._columns_for = (self.num_changes, rows)
            self._columns = (list(map(self.sampling.__getitem__, rows)), list(map(self.lora.__getitem__, rows)))
        return self._columns

    def forget_all_if_stale(self) -> None:
        if self.stale:
            self._let_go(np.flatnonzero(self.known).tolist())
            self.known[:] = False
            self.limit[:] = 0
            self.stale = False

    def fast(self, rows: np.ndarray) -> np.ndarray:
        """[n] bool: the row's request decodes plainly at start + 1 this step, no rule to apply one at a time:
        known, room in its pages, and no reason to wait for its launched step (`Scheduler.must_wait`: its
        token count below `wait_at`; and not its first decode, whose position may be a GDN snapshot point:
        a known row's start + 1 is past its prompt, as a decode row's start is not before it)."""
        return self.start[rows] < self.limit[rows]

    def opens_page(self, rows: np.ndarray) -> np.ndarray:
        """[n] bool: known rows that would be `fast` but for their next position, which opens a page."""
        nxt = self.start[rows] + 1  # [n]
        return self.known[rows] & (nxt == self.room[rows]) & (nxt + 1 < self.wait_at[rows])

    def open_pages(self, running: list[Request], rows: np.ndarray, fast: np.ndarray, budget: int,
                   allocator: PageAllocator) -> None:
        """The leading run of known rows of `running` (rows `rows` [n]) whose next position opens a page
        (every one in `page_size` steps, for all alike when they started together) take a page each in one
        allocation, in order, when there are free pages for all without evicting cached ones, as one at a
        time would give them (otherwise the scheduler's rules take them one at a time): `fast` [n] is set
        for them."""
        opens = self.opens_page(rows)  # [n]
        if not opens.any():
            return
        ready = fast | opens
        end = min(budget, len(rows) if ready.all() else int(np.argmin(ready)))
        at = np.flatnonzero(opens[:end])  # [m]
        if not at.size or len(allocator.free_pages) < at.size:
            return
        pages = allocator.alloc(at.size)
        for k, page in zip(at.tolist(), pages):
            running[k].pages.append(page)
        self.grow_each(rows[at], pages)
        fast[at] = True

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[n] int64 KV slots of token `positions[i]` of the request in row `rows[i]` (within its pages)."""
        page_size = self.page_size
        return self.pages[rows, positions // page_size].astype(np.int64) * page_size + positions % page_size

    def launched(self, rows: np.ndarray, starts: np.ndarray, all_known: bool, requests: list[Request]) -> int:
        """Plain decode rows launched at `starts`, of `requests` (their state as `known` says, their computed
        count start + 1 kept here from now: `computed_tokens`); the launch's number. (`all_known`: every row
        was known already, its `limit` as it is, its request's count kept here.)"""
        self.num_launches += 1
        self.in_flight[rows] = True
        self.start[rows] = starts
        self.launch[rows] = self.num_launches
        if not all_known:
            self.known[rows] = True
            self._limit(rows)
            deque(map(setattr, requests, repeat("computed_in"), repeat(self)), maxlen=0)
        return self.num_launches

    def computed_tokens(self, row: int) -> int:
        """`Request.num_computed_tokens` of the request holding known `row`: its launched decode's start + 1."""
        return int(self.start[row]) + 1

    def _let_go(self, rows: list[int]) -> None:
        """The requests of `rows` whose computed count is kept here take it back (before the rows are forgotten
        or handed over)."""
        for row in rows:
            req = self.holders[row]
            if req is not None and req.computed_in is self:
                req.num_computed_tokens = self.computed_tokens(row)

    def collected(self, rows: np.ndarray, launch: int, token_ids: list[int]) -> None:
        """Launch number `launch` of `rows` was read: it sampled `token_ids` [n] (a row launched again since,
        or handed over, is left alone)."""
        current = self.launch[rows] == launch  # [n]
        if current.all():
            self.in_flight[rows] = False
            self.last_token[rows] = token_ids
        else:
            self.in_flight[rows[current]] = False
            self.last_token[rows[current]] = np.asarray(token_ids, dtype=np.int64)[current]


def decode_wait_tokens(req: Request, max_model_len: int) -> int:
    """`Request.decode_wait_tokens` of a plain decode: `Scheduler.must_wait`'s rule for one with a launched
    step and a pending token, as a token count (0: it always waits)."""
    params = req.sampling_params
    if req.pooling is not None or req.grammar is not None or params.reads_output_tokens:
        return 0
    return max_model_len if params.max_tokens is None else min(max_model_len, req.num_prompt_tokens + params.max_tokens)


class UnusedDecodeTable:
    """The table of a scheduler that takes no decode rows (speculative decoding, n-gram or MTP, verifies every
    request as a chunk; an executor without `takes_decode_rows`): the scheduler's and the engine's writes keep
    nothing."""

    def admit(self, req: Request, row: int) -> None:
        """Nothing kept."""

    def release(self, row: int) -> None:
        """Nothing kept."""

    def grow(self, row: int, first: int, pages: list[int]) -> None:
        """Nothing kept."""

    def forget(self, rows: list[int]) -> None:
        """Nothing kept."""
