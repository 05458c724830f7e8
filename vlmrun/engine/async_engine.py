"""Async front of the engine: one background thread owns the `Engine`; asyncio code talks to it.

The engine is single-threaded, so exactly one thread (the *engine thread*, started by
`AsyncEngine.start`) ever calls `add_request`, `step`, `abort` and `release`. Everything else
talks to it through a thread-safe command queue:

- `await submit(group_id, [(prompt, params), ...])` queues the requests of one group (the `n`
  choices of a chat request, or the prompts x `n` of a completion request) and waits until the
  engine thread has accepted them all, or raises what `Engine.add_request` raised
  (`processors.InputError` for a prompt longer than the context, ...). A group is all-or-nothing.
- `RequestGroup.next_batch()` waits for output: everything the engine produced for the group
  since the last call, as `ChoiceDelta`s tagged with their choice index.
- `abort(group_id)` (or `RequestGroup.abort()`) drops the group's requests and frees their KV
  pages (and GDN slots) at the start of the engine's next iteration.

Results reach asyncio through `loop.call_soon_threadsafe`, once per engine step and event loop
(not once per token), so the HTTP handlers never block on the engine and the engine never waits
for the handlers. The engine thread publishes an `EngineStats` snapshot after every iteration
(read it from any thread: it is replaced, never mutated).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from processors import ProcessedPrompt
from vlmrun.engine.engine import Engine, RequestUpdate
from vlmrun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FINISH_ABORT = "abort"


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


class EngineStepError(RuntimeError):
    """An engine step failed; the requests it touched were dropped."""


@dataclass
class ChoiceDelta:
    """What one engine iteration produced for one choice of a group.

    On the last delta of a choice (`finished`), `num_prompt_tokens` / `num_output_tokens` are the
    final counts and `first_token_time` the `time.monotonic()` of its first token (None if none).
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


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by the engine thread after an iteration."""

    num_running: int = 0
    num_waiting: int = 0
    num_groups: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    req_rows_used: int = 0
    gdn_slots_used: Optional[int] = None  # None: the model has no GDN state pool
    gdn_slots_total: Optional[int] = None
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    time: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def gdn_usage(self) -> Optional[float]:
        if self.gdn_slots_used is None or not self.gdn_slots_total:
            return None
        return self.gdn_slots_used / self.gdn_slots_total


class RequestGroup:
    """The output side of one submitted group; lives on the event loop that submitted it."""

    def __init__(self, engine: "AsyncEngine", group_id: str, size: int, loop: asyncio.AbstractEventLoop):
        self.group_id = group_id
        self.size = size
        self.loop = loop
        self._engine = engine
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
            self._engine.abort(self.group_id)


# ---------------------------------------------------------------------------- commands


@dataclass
class _Add:
    group: RequestGroup
    items: list[tuple[ProcessedPrompt, SamplingParams]]
    accepted: asyncio.Future


@dataclass
class _Abort:
    group_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Live:
    """Engine-thread bookkeeping for one engine request."""

    group: RequestGroup
    index: int
    num_prompt_tokens: int


class AsyncEngine:
    """Owns an `Engine` and the thread that drives it."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 1.0):
        self.engine = engine
        self._commands: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._idle_poll_s = idle_poll_s
        self._stats = EngineStats()
        self._dead: Optional[str] = None
        # Engine-thread state (touched only there):
        self._live: dict[str, _Live] = {}
        self._groups: dict[str, list[str]] = {}
        # Per event loop: (RequestGroup, ChoiceDelta | exception) and (acceptance future, None | exception)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        self._num_steps = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "AsyncEngine":
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="vlmrun-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; unfinished groups get EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ------------------------------------------------------------------ asyncio side

    async def submit(self, group_id: str,
                     items: Sequence[tuple[ProcessedPrompt, SamplingParams]]) -> RequestGroup:
        """Queue a group of requests; returns once the engine accepted them all (or raises)."""
        if not items:
            raise ValueError("a request group needs at least one (prompt, params) pair")
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        group = RequestGroup(self, group_id, len(items), loop)
        accepted = loop.create_future()
        self._commands.put(_Add(group, list(items), accepted))
        try:
            while not accepted.done():
                await asyncio.wait({accepted}, timeout=self._idle_poll_s)
                if not accepted.done() and not (self._thread is not None and self._thread.is_alive()):
                    raise EngineDeadError(self._dead or "the engine is not running")
            accepted.result()
        except asyncio.CancelledError:
            self.abort(group_id)  # FIFO: lands after the add, so nothing leaks
            accepted.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody will read it
            raise
        return group

    def abort(self, group_id: str) -> None:
        """Thread-safe: drop the group's unfinished requests and free their memory."""
        self._commands.put(_Abort(group_id))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, refuse new work
            logger.exception("engine thread crashed")
            self._dead = f"the engine thread crashed: {type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(self._dead))
            self._flush()
        finally:
            if self._dead is None:
                self._dead = "the engine was shut down"
            self._drain_after_stop()

    def _loop_forever(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            for cmd in self._take_commands(block=idle):
                if isinstance(cmd, _Stop):
                    self._dead = "the engine was shut down"
                    self._fail_all(EngineDeadError(self._dead))
                    self._flush()
                    return
                self._apply(cmd)
            if self._outbox:  # acceptances go out after the stats that count the new requests
                self._publish_stats()
                self._flush()
            if self.engine.has_unfinished():
                try:
                    updates = self.engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; dropping its requests")
                    self._fail_all(EngineStepError(f"the engine failed: {type(exc).__name__}: {exc}"))
                else:
                    self._num_steps += 1
                    for update in updates:
                        self._route(update)
            self._publish_stats()
            self._flush()

    def _take_commands(self, block: bool) -> list[Any]:
        cmds: list[Any] = []
        if block:
            try:
                cmds.append(self._commands.get(timeout=self._idle_poll_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            self._abort_group(cmd.group_id, notify=True)

    def _add(self, cmd: _Add) -> None:
        group = cmd.group
        if group.group_id in self._groups:
            self._resolve(group.loop, cmd.accepted, ValueError(f"request id {group.group_id!r} is already in use"))
            return
        added: list[str] = []
        try:
            for index, (prompt, params) in enumerate(cmd.items):
                rid = f"{group.group_id}-{index}"
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
                self._live[rid] = _Live(group, index, len(prompt.token_ids))
        except Exception as exc:
            for rid in added:
                self.engine.abort(rid)
                self._live.pop(rid, None)
            self._resolve(group.loop, cmd.accepted, exc)
            return
        self._groups[group.group_id] = added
        self._resolve(group.loop, cmd.accepted, None)

    def _abort_group(self, group_id: str, notify: bool) -> None:
        for rid in self._groups.pop(group_id, []):
            live = self._live.pop(rid, None)
            if live is None:
                continue  # already finished and released
            self.engine.abort(rid)
            if notify:
                self._emit(live.group, ChoiceDelta(live.index, finished=True, finish_reason=FINISH_ABORT,
                                                   num_prompt_tokens=live.num_prompt_tokens))

    def _route(self, update: RequestUpdate) -> None:
        live = self._live.get(update.request_id)
        if live is None:
            return
        delta = ChoiceDelta(live.index, list(update.new_token_ids), list(update.new_logprobs), update.text_delta)
        if update.finished:
            req = self.engine.release(update.request_id)
            self._live.pop(update.request_id, None)
            rids = self._groups.get(live.group.group_id)
            if rids is not None and all(r not in self._live for r in rids):
                del self._groups[live.group.group_id]
            delta.finished, delta.finish_reason = True, update.finish_reason
            delta.num_prompt_tokens = req.num_prompt_tokens
            delta.num_output_tokens = len(req.output_token_ids)
            delta.first_token_time = req.first_token_time
        self._emit(live.group, delta)

    def _fail_all(self, exc: BaseException) -> None:
        groups = {live.group.group_id: live.group for live in self._live.values()}
        for group_id, group in groups.items():
            self._abort_group(group_id, notify=False)
            self._emit(group, exc)

    def _emit(self, group: RequestGroup, item: Any) -> None:
        self._outbox.setdefault(group.loop, []).append((group, item))

    def _flush(self) -> None:
        """Hand this iteration's output to each event loop in one call."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _resolve(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: Optional[BaseException]) -> None:
        self._outbox.setdefault(loop, []).append((fut, exc))

    def _publish_stats(self) -> None:
        caches = self.engine.caches
        allocator = caches.allocator
        sched = self.engine.scheduler
        rows_used = caches.req_to_token.max_reqs - caches.req_to_token.num_free()
        gdn = None if caches.gdn_pool is None else (rows_used, caches.gdn_pool.num_slots - 1)  # slot = row + 1
        prefix = self.engine.prefix_cache_stats()
        self._stats = EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_groups=len(self._groups),
            kv_pages_used=allocator.num_usable_pages() - allocator.num_free_pages(),
            kv_pages_total=allocator.num_usable_pages(),
            req_rows_used=rows_used,
            gdn_slots_used=gdn[0] if gdn else None, gdn_slots_total=gdn[1] if gdn else None,
            num_steps=self._num_steps, num_preemptions=sched.num_preemptions,
            prefix_query_tokens=prefix.query_tokens, prefix_hit_tokens=prefix.hit_tokens, time=time.monotonic())

    def _drain_after_stop(self) -> None:
        """After the loop ended: refuse whatever is still queued."""
        dead = EngineDeadError(self._dead or "the engine is not running")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._resolve(cmd.group.loop, cmd.accepted, dead)
        self._flush()
        try:
            self._publish_stats()
        except Exception:  # the engine itself may be what broke
            pass


def _deliver(items: list[tuple[Any, Any]]) -> None:
    """On the event loop: push outputs to their groups, settle acceptance futures."""
    for target, item in items:
        if isinstance(target, RequestGroup):
            target._push(item)
        elif not target.done():  # an acceptance future (its waiter may have been cancelled)
            if item is None:
                target.set_result(None)
            else:
                target.set_exception(item)


def gdn_pool_usage(runner: Any) -> Optional[tuple[int, int]]:
    """(slots used, slots usable) of the runner's GDN state pool, or None when it has none.

    The pool is `runner.gdn_pool` (or `state_pool`). If it keeps its own free list
    (`num_free_slots()`, `num_free()` or `free_slots`, with `num_usable_slots()`, `num_slots` or
    `max_slots`), that is read; otherwise slots follow the request rows (slot = row + 1, slot 0
    the dummy), so the slots in use are the `ReqToTokenPool` rows in use.
    """
    pool = next((getattr(runner, name) for name in ("gdn_pool", "state_pool")
                 if getattr(runner, name, None) is not None), None)
    if pool is None:
        return None
    free = _first_count(pool, ("num_free_slots", "num_free", "free_slots"))
    total = _first_count(pool, ("num_usable_slots", "max_slots"))
    if free is not None:
        total = total if total is not None else _first_count(pool, ("num_slots",))
        return (total - free, total) if total is not None else None
    req_pool = getattr(runner, "req_pool", None)
    if req_pool is None:
        return None
    slots = _first_count(pool, ("num_slots",))
    usable = slots - 1 if slots is not None else req_pool.max_reqs
    return req_pool.max_reqs - req_pool.num_free(), usable


def _first_count(obj: Any, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = getattr(obj, name, None)
        if value is None:
            continue
        if callable(value):
            value = value()
        if isinstance(value, (list, tuple, set, deque)):
            value = len(value)
        if isinstance(value, int):
            return value
    return None
