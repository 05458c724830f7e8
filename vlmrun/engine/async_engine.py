"""Async front of the engine: one background thread owns the `Engine`; asyncio code talks to it.

The engine is single-threaded, so exactly one thread (the *engine thread*, started by
`AsyncEngine.start`) ever calls `add_request`, `step`, `abort` and `release`. Everything else
talks to it through a thread-safe command queue:

- `await submit(group_id, [(prompt, params), ...])` queues the requests of one group (the `n`
  choices of a chat request, or the prompts x `n` of a completion request) and waits until the
  engine thread has accepted them all, or raises what `Engine.add_request` raised
  (`processors.InputError` for a prompt longer than the context, ...). A group is all-or-nothing.
  `stream=False` (a consumer that reads only each choice's whole answer: the server's non-streamed
  requests) adds them so (`Engine.add_request(..., stream=False)`): no per-step delta, text or event-loop
  wake-up, but an empty delta with the choice's `first_token_time` when its first token comes, and a last
  delta holding the whole answer (text, token ids, logprobs), as the streamed deltas joined would.
- `RequestGroup.next_batch()` waits for output: everything the engine produced for the group
  since the last call, as `ChoiceDelta`s tagged with their choice index. A choice's first delta after its
  first token carries `first_token_time` (the engine's time of the step that brought it).
- `abort(group_id)` (or `RequestGroup.abort()`) drops the group's requests and frees their KV
  pages (and GDN slots) at the start of the engine's next iteration.

Results reach asyncio through `loop.call_soon_threadsafe`, once per engine step and event loop
(not once per token), so the HTTP handlers never block on the engine and the engine never waits
for the handlers. The engine thread publishes an `AsyncEngineStats` snapshot (`Engine.stats()`
plus its own counts, and the per-step token metrics its engine's `TokenTiming` keeps for every request,
streamed or not: `engine/token_timing.py`) after every iteration (read it from any thread: it is
replaced, never mutated).
The event-loop side of a group (`RequestGroup`, `ChoiceDelta`, the errors) is `request_group.py`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

from vlmrun.processors import ProcessedPrompt
from vlmrun.engine.engine import Engine, EngineStats
from vlmrun.engine.outputs import RequestUpdate
from vlmrun.lora.request import LoRARequest
from vlmrun.engine.step_tokens import BucketHistogram, StepTokenHistogram
from vlmrun.engine.token_timing import TokenTiming
from vlmrun.engine.request_group import (
    FINISH_ABORT,
    ChoiceDelta,
    EngineDeadError,
    EngineStepError,
    RequestGroup,
    deliver,
)
from vlmrun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncEngineStats(EngineStats):
    """`Engine.stats()` as the engine thread took it after an iteration, plus the thread's own counts."""

    num_groups: int = 0
    num_steps: int = 0  # engine steps run (failed steps not counted)
    step_tokens: Optional[StepTokenHistogram] = None  # tokens per step (prompt tokens prefilled + generated)
    generation_tokens: int = 0  # output tokens generated (engine/token_timing.py)
    token_gaps: Optional[BucketHistogram] = None  # inter-token latencies in seconds (engine/token_timing.py)
    time: float = 0.0  # time.monotonic() of the snapshot


# ---------------------------------------------------------------------------- commands


@dataclass
class _Add:
    group: RequestGroup
    items: list[tuple[ProcessedPrompt, SamplingParams]]
    accepted: asyncio.Future
    lora: Optional[LoRARequest] = None  # the group's LoRA adapter (None: the base model)
    priority: int = 0  # the group's scheduling priority (the "priority" policy: lower first)
    stream: bool = True  # False: the engine hands out only each request's first-token signal and result


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
    stream: bool = True  # False: its last update's result is its whole answer
    started: bool = False  # its first update came (its first token, or its end)


class AsyncEngine:
    """Owns an `Engine` and the thread that drives it."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 1.0):
        self.engine = engine
        self._commands: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._idle_poll_s = idle_poll_s
        self._stats = AsyncEngineStats()
        self._dead: Optional[str] = None
        # Engine-thread state (touched only there):
        self._live: dict[str, _Live] = {}
        self._groups: dict[str, list[str]] = {}
        # Per event loop: (RequestGroup, ChoiceDelta | exception) and (acceptance future, None | exception)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        self._num_steps = 0
        if not isinstance(engine.token_timing, TokenTiming):  # the engine keeps the per-step token metrics from now
            engine.token_timing = TokenTiming(engine.caches.req_to_token.max_reqs)
        self._timing = engine.token_timing

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
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def stats(self) -> AsyncEngineStats:
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def compile_structured(self, params: SamplingParams) -> None:
        """Any thread: compile the grammar of `params` now, so that the engine thread finds it cached
        (`Engine.compile_structured`; StructuredOutputError when it does not compile)."""
        self.engine.compile_structured(params)

    # ------------------------------------------------------------------ asyncio side

    async def submit(self, group_id: str, items: Sequence[tuple[ProcessedPrompt, SamplingParams]],
                     lora_request: Optional[LoRARequest] = None, *, priority: int = 0,
                     stream: bool = True) -> RequestGroup:
        """Queue a group of requests (`priority`: theirs, `Engine.add_request`'s; `stream` False: only each
        choice's first-token delta and its whole answer, module docstring); returns once the engine
        accepted them all (or raises)."""
        if not items:
            raise ValueError("a request group needs at least one (prompt, params) pair")
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        group = RequestGroup(group_id, len(items), loop, self.abort)
        accepted = loop.create_future()
        self._commands.put(_Add(group, list(items), accepted, lora_request, priority, stream))
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
                    self._timing.end_step()
                    for update in updates:
                        self._route(update, self._timing.step_time)
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
                self.engine.add_request(rid, prompt, params, lora_request=cmd.lora, priority=cmd.priority,
                                        stream=cmd.stream)
                added.append(rid)
                self._live[rid] = _Live(group, index, len(prompt.token_ids), cmd.stream)
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

    def _route(self, update: RequestUpdate, step_time: float) -> None:
        """`update` as its choice's delta (`step_time`: the collect of the step it came from). A request that
        does not stream gets its whole answer, from its result, in its last delta."""
        live = self._live.get(update.request_id)
        if live is None:
            return
        result = update.result
        if result is None or live.stream:
            delta = ChoiceDelta(live.index, list(update.new_token_ids), list(update.new_logprobs), update.text_delta)
        else:
            delta = ChoiceDelta(live.index, list(result.token_ids), list(result.logprobs or ()), result.text)
        if not live.started:  # its first update: its first token came in this step (or it ended: the result says)
            live.started = True
            delta.first_token_time = step_time
        if result is not None:
            self._live.pop(update.request_id, None)
            rids = self._groups.get(live.group.group_id)
            if rids is not None and all(r not in self._live for r in rids):
                del self._groups[live.group.group_id]
            delta.finished, delta.finish_reason = True, result.finish_reason
            delta.num_prompt_tokens = result.num_prompt_tokens
            delta.num_output_tokens = result.num_output_tokens
            delta.first_token_time = result.first_token_time
            delta.prompt_logprobs, delta.pooled = result.prompt_logprobs, result.pooled
            delta.stop_reason = result.stop_reason
            delta.arrival_time, delta.scheduled_time = result.arrival_time, result.scheduled_time
            delta.finished_time = result.finished_time
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
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _resolve(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: Optional[BaseException]) -> None:
        self._outbox.setdefault(loop, []).append((fut, exc))

    def _publish_stats(self) -> None:
        stats = self.engine.stats()  # its fields as they are (a nested dataclass stays one)
        own = {f.name: getattr(stats, f.name) for f in fields(stats)}
        timing = self._timing.snapshot()
        self._stats = AsyncEngineStats(**own, num_groups=len(self._groups), num_steps=self._num_steps,
                                       step_tokens=timing.step_tokens, generation_tokens=timing.generated,
                                       token_gaps=timing.gaps, time=time.monotonic())

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
