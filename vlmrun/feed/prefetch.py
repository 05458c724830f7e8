"""The prefetch: a feeder thread reads the inputs lazily, worker threads preprocess them, the engine's
thread takes them as they are ready.

    works ──feeder──▶ tasks (2 per worker) ──N workers: prepare()──▶ ready ──take()──▶ the engine's thread

A worker holds one of `prefetch` slots from before it preprocesses an input until the engine's thread
takes the result, so at most `prefetch` processed prompts (pixel tensors) exist ahead of the engine,
whatever the number of inputs. Results come out in the order they finish (a slow image does not hold
back the others); each carries its input's index. A failing `prepare` is that input's error, never
the pipeline's; an input iterator that raises ends the feed, and `feed_error` keeps what it raised.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from vlmrun.processors import InputError, ProcessedPrompt

POLL_S = 0.05  # how often blocked threads look at the stop flag
_STOP = object()  # tasks: no more inputs


class FeedDone:
    """`take()`'s answer once every input has been handed out."""


FEED_DONE = FeedDone()


@dataclass
class Prepared:
    """One input, preprocessed: its prompt, or why it could not be (error)."""

    index: int  # position in the inputs
    work: Any  # the input as the caller gave it
    prompt: Optional[ProcessedPrompt]
    error: Optional[str]
    preprocess_s: float


def describe_error(exc: BaseException) -> str:
    """The message a failed input carries: InputError's own text, else `Type: message`."""
    if isinstance(exc, InputError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def check_sizes(workers: int, prefetch: int) -> None:
    """ValueError unless both are >= 1."""
    for name, value in (("workers", workers), ("prefetch", prefetch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class Prefetcher:
    """Preprocesses `works` with `prepare` on `workers` threads, at most `prefetch` ahead (module docstring).
    `prepare` may be one callable per worker (thread i runs prepare[i]: its worker process, `process_workers.py`).

    Only one thread calls `take`; `close` stops the threads (results not taken are dropped)."""

    def __init__(self, works: Iterable[Any], prepare: Union[Callable[[Any], ProcessedPrompt],
                                                           Sequence[Callable[[Any], ProcessedPrompt]]],
                 workers: int, prefetch: int, name: str = "vlmrun-prep"):
        check_sizes(workers, prefetch)
        self.prepares = list(prepare) if isinstance(prepare, Sequence) else [prepare] * workers
        if len(self.prepares) != workers:
            raise ValueError(f"{len(self.prepares)} prepare callables for {workers} workers")
        self.workers = workers
        self.preprocessed = 0  # inputs prepared so far (progress); written by the workers, read anywhere
        self.feed_error: Optional[BaseException] = None
        self._slots = threading.Semaphore(prefetch)
        self._tasks: queue.Queue = queue.Queue(maxsize=2 * workers)
        self._ready: queue.Queue = queue.Queue()  # bounded by the slots
        self._stop = threading.Event()
        self._count_lock = threading.Lock()
        self._workers_left = workers
        self._threads = [threading.Thread(target=self._feed, args=(works,), name=f"{name}-feeder", daemon=True)]
        self._threads += [threading.Thread(target=self._work, args=(self.prepares[i],), name=f"{name}-{i}", daemon=True)
                          for i in range(workers)]
        for t in self._threads:
            t.start()

    def take(self, wait: bool) -> Union[Prepared, FeedDone, None]:
        """The next preprocessed input; FEED_DONE once all were handed out; None when none is ready and
        not `wait` (with `wait`, blocks until one is). Frees its prefetch slot: the caller owns it now."""
        if not self._workers_left:
            return FEED_DONE
        while True:
            try:
                got = self._ready.get(timeout=POLL_S) if wait else self._ready.get_nowait()
            except queue.Empty:
                if not wait:
                    return None
                continue
            if got is _STOP:  # one worker has exited
                self._workers_left -= 1
                if not self._workers_left:
                    return FEED_DONE
                continue
            self._slots.release()
            return got

    def close(self) -> None:
        """Stop the feeder and the workers (an input being preprocessed finishes first, unless it takes
        longer than a few seconds)."""
        self._stop.set()
        for q in (self._tasks, self._ready):
            _drain(q)
        for t in self._threads:
            t.join(timeout=5.0)

    # ------------------------------------------------------------------ threads

    def _feed(self, works: Iterable[Any]) -> None:
        try:
            for index, work in enumerate(works):
                if not self._put(self._tasks, (index, work)):
                    return
        except BaseException as exc:  # an input iterator that fails mid-way: the caller raises it at the end
            self.feed_error = exc
        for _ in range(self.workers):
            if not self._put(self._tasks, _STOP):
                return

    def stopped(self) -> bool:
        """True once `close` was called."""
        return self._stop.is_set()

    def _work(self, prepare: Callable[[Any], ProcessedPrompt]) -> None:
        # Torch's OpenMP thread count is per calling thread: one each here, so preprocessing threads
        # never start OpenMP teams that spin on the cores the engine's step needs.
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                task = self._tasks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if task is _STOP:
                self._ready.put(_STOP)
                return
            while not self._slots.acquire(timeout=POLL_S):
                if self._stop.is_set():
                    return
            self._ready.put(self._prepare(prepare, *task))

    def _prepare(self, prepare: Callable[[Any], ProcessedPrompt], index: int, work: Any) -> Prepared:
        start = time.perf_counter()
        try:
            prompt, error = prepare(work), None
        except Exception as exc:  # any failure of one input is that input's error, never the pipeline's end
            prompt, error = None, describe_error(exc)
        with self._count_lock:
            self.preprocessed += 1
        return Prepared(index, work, prompt, error, time.perf_counter() - start)

    def _put(self, q: queue.Queue, value: Any) -> bool:
        """Blocking put that gives up (False) once stopped."""
        while not self._stop.is_set():
            try:
                q.put(value, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
