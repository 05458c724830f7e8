"""The event-loop side of the async engine: what one submitted group of requests gets back.

`AsyncEngine.submit` returns a `RequestGroup`; the engine thread hands it `ChoiceDelta`s (or the
exception that failed it) through `deliver`, which runs on the group's event loop, and
`RequestGroup.next_batch()` gives the consumer everything queued since its last call. Nothing here
touches the `Engine`: aborting goes back through the callable the group was made with.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

FINISH_ABORT = "abort"


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


class EngineStepError(RuntimeError):
    """An engine step failed; the requests it touched were dropped."""


@dataclass
class ChoiceDelta:
    """What one engine iteration produced for one choice of a group.

    A streamed choice's deltas carry its new tokens, logprobs and text; a choice submitted with
    `stream=False` gets an empty delta when its first token comes and its whole answer in its last.
    The first delta of a choice carries `first_token_time`, the `time.monotonic()` of the engine step that
    brought its first token (the time to first token's end).
    On the last delta of a choice (`finished`), `num_prompt_tokens` / `num_output_tokens` are the
    final counts, `first_token_time` the `time.monotonic()` of its first token (None if none) and
    `prompt_logprobs` the prompt's (`SamplingParams.prompt_logprobs`; None unless asked);
    `stop_reason` the stop string or stop token id that ended it (None for EOS, length, abort), and
    `arrival_time` / `scheduled_time` / `finished_time` the engine's `time.monotonic()` when it took the
    request, first scheduled it and finished it (None on an abort: the metrics' queue / prefill / decode times).
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: Optional[float] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    pooled: Any = None  # a pooling request's embedding (torch.Tensor [dim] float32, CPU) on its last delta
    stop_reason: Union[int, str, None] = None
    arrival_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    finished_time: Optional[float] = None


class RequestGroup:
    """The output side of one submitted group; lives on the event loop that submitted it."""

    def __init__(self, group_id: str, size: int, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]):
        self.group_id = group_id
        self.size = size
        self.loop = loop
        self._abort = abort  # drops the group's requests in the engine (thread-safe)
        self._pending: deque[Union[ChoiceDelta, BaseException]] = deque()
        self._wakeup = asyncio.Event()
        self._open = set(range(size))  # choices not finished yet (as seen by the consumer)
        self.submit_time = time.monotonic()

    @property
    def finished(self) -> bool:
        return not self._open

    def _push(self, item: Union[ChoiceDelta, BaseException]) -> None:  # event-loop thread only
        if self._open:  # after an abort (or the end), late output is dropped
            self._pending.append(item)
        self._wakeup.set()

    async def next_batch(self) -> list[ChoiceDelta]:
        """Wait for output; return every delta queued so far (empty once the group is finished).

        Raises EngineStepError / EngineDeadError when the engine failed this group.
        """
        while not self._pending:
            if self.finished:
                return []
            self._wakeup.clear()
            await self._wakeup.wait()
        out: list[ChoiceDelta] = []
        while self._pending:
            item = self._pending.popleft()
            if isinstance(item, BaseException):
                self._open.clear()
                raise item
            if item.finished:
                self._open.discard(item.index)
            out.append(item)
        return out

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        batch = await self.next_batch()
        if not batch and self.finished:
            raise StopAsyncIteration
        return batch

    def abort(self) -> None:
        """Drop the unfinished requests of this group (no-op when all are finished); output not
        yet read is discarded and `next_batch` returns [] from now on."""
        if not self.finished:
            self._open.clear()
            self._pending.clear()
            self._abort(self.group_id)


def deliver(items: list[tuple[Any, Any]]) -> None:
    """On the event loop: push outputs to their groups, settle acceptance futures."""
    for target, item in items:
        if isinstance(target, RequestGroup):
            target._push(item)
        elif not target.done():  # an acceptance future (its waiter may have been cancelled)
            if item is None:
                target.set_result(None)
            else:
                target.set_exception(item)
