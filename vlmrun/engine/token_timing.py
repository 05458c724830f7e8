"""`TokenTiming`: the token metrics the server reads of every engine step, kept on the engine thread.

The server's token metrics (vLLM's `generation_tokens`, `inter_token_latency_seconds` and its older name
`time_per_output_token_seconds`, `iteration_tokens_total`) need something of every step of every request.
A request that does not stream (`Engine.add_request(..., stream=False)`: the server's non-streamed HTTP
requests) hands its consumer nothing per step, so they are taken here, where the engine collects a step,
for every request alike (streamed or not): as vLLM v1 takes them in its output processor per engine step,
at the engine's time of the step.

- `last` [rows]: per page-table row, the `time.monotonic()` of the collect that brought its request's last
  token (NaN: the row holds no request with a token, or its request finished or was aborted). A step's
  plain decode rows (one token each) are read and written with numpy, no Python per row
  (`decodes_collected`); a chunk's token (a prefill's first token; a grammar's, a speculative verify's, a
  recompute's) goes through `chunk_token` / `chunk_appended`, one call each per chunk.
- `gaps`: the inter-token latencies, one per request per step that brought it tokens after its first
  (the gap since the step that brought its previous tokens; several tokens of one step, accepted drafts,
  share one gap, as in vLLM): a request of `k` tokens in `k` steps gives `k - 1`. The first step after a
  preemption's recompute gives one only when the request got its old row back (the time of a moved
  request's last token is not kept).
- `generated`: output tokens appended so far (a token of a request that finished or was aborted while its
  step ran is not one); `step_tokens`: per collect, the tokens generated plus the prompt tokens of the
  requests whose first token came in it.

The engine calls it from `_collect` / `_collect_decodes` and `release`s a row when its request finishes or
is aborted; the async engine (which gives its engine one: `Engine.token_timing`) calls `end_step` after each
`Engine.step` and publishes `snapshot()` after each iteration. An engine nobody reads
these of (`LLM`, the jobs) keeps an `UnusedTokenTiming`, whose calls do nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from vlmrun.engine.request import Request
from vlmrun.engine.step_tokens import BucketHistogram, StepTokenHistogram

# vLLM's buckets for inter_token_latency_seconds / time_per_output_token_seconds (seconds)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


@dataclass(frozen=True)
class TokenTimingStats:
    """A copy of `TokenTiming`'s counts (safe to read from any thread)."""

    generated: int = 0  # output tokens generated
    gaps: Optional[BucketHistogram] = None  # inter-token latencies (seconds)
    step_tokens: Optional[StepTokenHistogram] = None  # tokens per collected step


class TokenTiming:
    """Per page-table row, the time of its request's last token; the counts made of them (module docstring)."""

    def __init__(self, num_rows: int):
        self.last = np.full(num_rows, np.nan)  # [rows] time.monotonic() of the last token's collect
        self.holder = np.zeros(num_rows, dtype=np.int64)  # [rows] id() of the request a chunk token last timed there
        self.gaps = BucketHistogram(ITL_BUCKETS)
        self.step_tokens = StepTokenHistogram()
        self.generated = 0
        self.step_time = 0.0  # time.monotonic() of the last collect with tokens (its new requests' first token time)
        self._this_step = 0

    def decodes_collected(self, rows: Union[np.ndarray, Sequence[int]], now: float) -> None:
        """A step's plain decode rows `rows` [n] were collected at `now`: one token each, but for a row whose
        request finished or was aborted while the step ran (its row released: NaN)."""
        self.step_time = now
        rows = np.asarray(rows, dtype=np.int64)
        before = self.last[rows]  # [n]
        live = ~np.isnan(before)  # [n]
        num_live = int(np.count_nonzero(live))
        if num_live < len(rows):
            rows, before = rows[live], before[live]
        self.gaps.observe_array(now - before)
        self.last[rows] = now
        self.generated += num_live
        self._this_step += num_live

    def chunk_token(self, req: Request, now: float) -> int:
        """A chunk of `req` sampled tokens, collected at `now`, about to be appended: the gap since its last
        one (none for its first token, or for the first after a recompute in another row), and its row's
        time. Returns its output length before them, for `chunk_appended`."""
        self.step_time, before, row = now, len(req.output_token_ids), req.req_pool_idx
        if row is None:
            return before
        last, key = float(self.last[row]), id(req)
        if before and self.holder[row] == key and not math.isnan(last):
            self.gaps.observe(now - last)
        self.holder[row], self.last[row] = key, now
        return before

    def chunk_appended(self, req: Request, before: int) -> None:
        """`req`'s chunk tokens were appended (its output was `before` tokens long); it may have finished."""
        new = len(req.output_token_ids) - before
        self.generated += new
        self._this_step += new + (req.num_prompt_tokens if before == 0 and new else 0)

    def release(self, req: Request) -> None:
        """`req` finished or was aborted (call before its row is freed): its row's tokens in a step still
        running are not counted."""
        if req.req_pool_idx is not None:
            self.last[req.req_pool_idx] = np.nan

    def end_step(self) -> None:
        """`Engine.step` returned: the tokens of the step it collected go into `step_tokens` (a step that only
        prefilled part of a prompt has none)."""
        if self._this_step:
            self.step_tokens.observe(self._this_step)
            self._this_step = 0

    def snapshot(self) -> TokenTimingStats:
        return TokenTimingStats(self.generated, self.gaps.copy(), self.step_tokens.copy())


class UnusedTokenTiming:
    """The timing of an engine nobody reads it of: every call does nothing."""

    step_time = 0.0

    def decodes_collected(self, rows: Union[np.ndarray, Sequence[int]], now: float) -> None:
        """Nothing kept."""

    def chunk_token(self, req: Request, now: float) -> int:
        return 0

    def chunk_appended(self, req: Request, before: int) -> None:
        """Nothing kept."""

    def release(self, req: Request) -> None:
        """Nothing kept."""

    def end_step(self) -> None:
        """Nothing kept."""

    def snapshot(self) -> TokenTimingStats:
        return TokenTimingStats()
