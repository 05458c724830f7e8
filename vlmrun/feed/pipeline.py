"""The engine loop of the input pipeline: inputs preprocessed ahead, submitted while the engine steps.

    works ──Prefetcher (feeder + worker threads, `prefetch` ahead)──▶ take() ──add_request──▶ engine.step()
          ──▶ Finished(index, ...) as each input's requests end, in the order they finish

- Memory is bounded by the prefetch and what the engine is about to encode, not by the number of inputs
  nor by max_num_seqs: the inputs are read lazily (any iterable, a generator included), at most
  `prefetch` processed prompts wait ahead of the engine, at most `max_in_flight` requests (default the
  engine's max_num_seqs) are in it, and a finished input keeps only its results (its prompt's token
  ids, no pixels). The engine drops a request's pixels once its images are encoded
  (`vlmrun.multimodal.vision_stage`), so only inputs with media whose prefill has not ended (no token
  yet) hold pixels in it; `_PrefillWindow` stops topping up while they are at least `prefetch` inputs
  and fill two steps' token budget (`max_num_batched_tokens`: the step being run and the next).
- Before every step the engine is topped up from the ready prompts, so the first step runs as soon as
  the first input is preprocessed and finished requests are replaced at once (continuous batching).
  A call whose inputs fit the prefetch (`whole_batch`) instead submits them all, in input order,
  before the first step: its schedule is that of one batch added at once, not a function of the
  worker threads' timing (tests and users comparing runs see the same steps).
  While the engine has work the loop never waits for preprocessing; it waits only when the engine is
  idle.
- One input may run several requests (`Work.params`: `n` choices); it finishes when all have.
- The requests are added with `stream=False`: the loop reads only each request's result and its first
  update (the step that collects its first token, which ends its prefill: `_PrefillWindow.leave`), so
  the engine makes no per-step update or text for them and decodes each text once, when it finishes.
- A bad input (one `prepare` fails on, or a prompt `add_request` refuses) finishes at once with its
  error; the others go on. Only the caller's thread touches the engine (`add_request`, `step`, `abort`);
  the workers run `prepare`, which uses only the processor.
- Each prompt's pixels are moved to an anonymous mapping of their own as a worker finishes it
  (`pixel_memory.py`), so pixels freed by the engine's thread leave no hole in a worker's heap.
- Between steps a `HeapTrimmer` (`vlmrun/executor/cpu_malloc.py`) hands the free memory glibc's heaps
  piled up back to the kernel once the RSS has grown past the working set, so the peak RSS of a long
  run does not grow with the number of inputs (fragmentation, not live data).
- Leaving `stream` early (an exception, Ctrl-C, a consumer that stops iterating) aborts this run's
  requests and stops the threads (and the worker processes), so the engine can be used again.
- Worker processes (`pool="process"`, `process_workers.py`): each worker thread hands its inputs to a
  process of its own, running `portable` (a picklable twin of `prepare`, `vlmrun/feed/prepare.py`);
  the processes live for one `stream`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from vlmrun.engine.outputs import RequestResult
from vlmrun.executor.cpu_malloc import HeapTrimmer
from vlmrun.feed.pixel_memory import map_pixels
from vlmrun.feed.prefetch import FeedDone, Prefetcher, Prepared, check_sizes, describe_error
from vlmrun.feed.process_workers import WorkerProcess
from vlmrun.lora.request import LoRARequest
from vlmrun.processors import ProcessedPrompt
from vlmrun.sampling_params import SamplingParams

DEFAULT_PREFETCH = 64  # processed prompts kept ready ahead of the engine
PREFILL_STEPS_AHEAD = 2  # the step running and the next one: the engine never waits for a top-up


@dataclass
class Work:
    """One input: `source` goes to the pipeline's `prepare` (in a worker); one request per `params` entry
    (its choices), ids `request_id-0`, `request_id-1`, ...; `lora` the adapter they run with."""

    request_id: str
    source: Any
    params: Sequence[SamplingParams]
    lora: Optional[LoRARequest] = None
    priority: int = 0  # the priority scheduling policy's (lower first)


@dataclass
class Finished:
    """One input, done: its results (one per `work.params`, None where the engine dropped the request), or
    its `error` (then `results` holds None for every choice)."""

    index: int  # position in the inputs
    work: Work
    results: list[Optional[RequestResult]]
    prompt_token_ids: list[int] = field(default_factory=list)
    error: Optional[str] = None
    preprocess_s: float = 0.0
    generate_s: float = 0.0  # from submission to the last result

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.results if r is not None)


@dataclass
class _Open:
    """An input whose requests are in the engine."""

    prepared: Prepared
    results: list[Optional[RequestResult]]
    prompt_token_ids: list[int]
    added: float
    left: int
    has_media: bool = False  # its prompt has images or videos
    in_window: bool = False  # counted in the `_PrefillWindow`

    def finished(self) -> Finished:
        p = self.prepared
        return Finished(p.index, p.work, self.results, self.prompt_token_ids, None, p.preprocess_s,
                        time.monotonic() - self.added)


@dataclass
class _PrefillWindow:
    """The submitted inputs with media that have no token yet (they may still hold their pixels): full
    once they are at least `min_inputs` and `min_tokens` prompt tokens (enough for the next steps)."""

    min_inputs: int
    min_tokens: int
    inputs: int = 0
    tokens: int = 0

    def full(self) -> bool:
        return self.inputs >= self.min_inputs and self.tokens >= self.min_tokens

    def enter(self, entry: _Open) -> None:
        if entry.has_media:
            entry.in_window = True
            self.inputs += 1
            self.tokens += len(entry.prompt_token_ids)

    def leave(self, entry: _Open) -> None:
        if entry.in_window:
            entry.in_window = False
            self.inputs -= 1
            self.tokens -= len(entry.prompt_token_ids)


class InputPipeline:
    """Runs streams of `Work` on one engine (module docstring). Runs never overlap; the caller's thread
    is the only one touching the engine.

    prepare: source -> ProcessedPrompt (raises for a bad input), called in the worker threads;
    workers: preprocessing threads (`vlmrun.feed.workers.preprocess_workers()` sizes them from the
    usable CPUs); prefetch: processed prompts ahead of the engine; max_in_flight: requests in the
    engine (None: its max_num_seqs); heap: what runs between steps to bound the heaps' free memory
    (None: a `HeapTrimmer` with its default slack); pool: "thread", or "process" to run `portable` (what
    `prepare` does, picklable) in one worker process per worker (`vlmrun.feed.workers.worker_pool`
    chooses)."""

    def __init__(self, engine: Any, prepare: Callable[[Any], ProcessedPrompt], *, workers: int,
                 prefetch: int = DEFAULT_PREFETCH, max_in_flight: Optional[int] = None,
                 heap: Optional[HeapTrimmer] = None, pool: str = "thread",
                 portable: Optional[Callable[[Any], ProcessedPrompt]] = None):
        check_sizes(workers, prefetch)
        if pool not in ("thread", "process") or (pool == "process" and portable is None):
            raise ValueError(f"pool must be 'thread', or 'process' with a portable prepare; got {pool!r}")
        self.pool = pool
        self.portable = portable
        self.engine = engine
        self.prepare = prepare
        self.workers = workers
        self.prefetch = prefetch
        self.max_in_flight = max_in_flight or engine.config.max_num_seqs
        self.preprocessed = 0  # inputs preprocessed by the current (or last) run
        self.heap = heap if heap is not None else HeapTrimmer()

    def stream(self, works: Iterable[Work], on_tick: Optional[Callable[[], None]] = None,
               whole_batch: bool = False) -> Iterator[Finished]:
        """Each input's `Finished` as it finishes (its `index` says which). Raises what the input
        iterator raised once the inputs before it are done, or what the engine raised.

        whole_batch: every input is preprocessed and submitted before the first step, in input order
        (for a call whose inputs fit the prefetch: the engine then schedules them exactly as one batch
        added at once, whatever the worker threads' timing)."""
        processes: list[WorkerProcess] = []
        stop = threading.Event()
        in_flight: dict[str, tuple[_Open, int]] = {}  # request id -> its input, choice
        window = _PrefillWindow(self.prefetch, PREFILL_STEPS_AHEAD * self.engine.config.max_num_batched_tokens)
        fed = False
        prefetcher: Optional[Prefetcher] = None
        try:
            prefetcher = Prefetcher(works, self._prepares(processes, stop), self.workers, self.prefetch)
            if whole_batch:  # all of them first, in input order (the workers finish in any order)
                for prep in sorted(self._take_all(prefetcher), key=lambda p: p.index):
                    failed = self._admit(prep, in_flight, window)
                    if failed is not None:
                        yield failed
                fed = True
            while True:
                while len(in_flight) < self.max_in_flight and not fed and not window.full():
                    got = prefetcher.take(wait=not in_flight)
                    self.preprocessed = prefetcher.preprocessed
                    if got is None:
                        break
                    if isinstance(got, FeedDone):
                        fed = True
                        break
                    failed = self._admit(got, in_flight, window)
                    if failed is not None:
                        yield failed
                if in_flight:
                    yield from self._step(in_flight, window)
                elif fed:
                    break
                if on_tick is not None:
                    on_tick()
        finally:
            for rid in in_flight:
                self.engine.abort(rid)
            stop.set()
            if prefetcher is not None:
                prefetcher.close()
            for process in processes:
                process.close()
        self.preprocessed = prefetcher.preprocessed
        if prefetcher.feed_error is not None:
            raise prefetcher.feed_error

    def _prepares(self, processes: list[WorkerProcess],
                  stop: threading.Event) -> list[Callable[[Any], ProcessedPrompt]]:
        """What each worker thread runs on a `Work`: `prepare` itself, or its own process's `portable`
        (the processes started are appended to `processes`, for the caller to close)."""
        if self.pool == "thread":  # the pixels in mappings of their own (`pixel_memory.py`)
            return [lambda work: map_pixels(self.prepare(work.source))] * self.workers
        assert self.portable is not None
        for i in range(self.workers):
            processes.append(WorkerProcess(self.portable, name=f"vlmrun-prep-process-{i}"))
        return [lambda work, p=p: p.run(work.source, stop.is_set) for p in processes]

    def _take_all(self, prefetcher: Prefetcher) -> list[Prepared]:
        """Every input, preprocessed (a whole batch: they fit the prefetch)."""
        batch = []
        while not isinstance(got := prefetcher.take(wait=True), FeedDone):
            batch.append(got)
        self.preprocessed = prefetcher.preprocessed
        return batch

    def _admit(self, prep: Prepared, in_flight: dict[str, tuple[_Open, int]],
               window: _PrefillWindow) -> Optional[Finished]:
        """Submit one input's requests; its `Finished` if it fails instead."""
        work: Work = prep.work
        prompt, prep.prompt = prep.prompt, None  # the engine's request holds it from here
        token_ids = [] if prompt is None else list(prompt.token_ids)
        if prep.error is None:
            entry = _Open(prep, [None] * len(work.params), token_ids, time.monotonic(), len(work.params),
                          has_media=bool(prompt.mm_items))
            added: list[str] = []
            try:
                for i, params in enumerate(work.params):
                    rid = f"{work.request_id}-{i}"
                    self.engine.add_request(rid, prompt, params, lora_request=work.lora, priority=work.priority,
                                            stream=False)  # only the result is read: no per-step text
                    added.append(rid)
                    in_flight[rid] = (entry, i)
                window.enter(entry)
                return None
            except Exception as exc:  # noqa: BLE001 - whatever the engine refuses is this input's error
                for rid in added:
                    self.engine.abort(rid)
                    del in_flight[rid]
                prep.error = describe_error(exc)
        return Finished(prep.index, work, [None] * len(work.params), token_ids, prep.error, prep.preprocess_s)

    def _step(self, in_flight: dict[str, tuple[_Open, int]], window: _PrefillWindow) -> list[Finished]:
        done: list[Finished] = []
        updates = self.engine.step()
        self.heap.after_step()
        for update in updates:
            if update.request_id not in in_flight:
                continue
            window.leave(in_flight[update.request_id][0])  # a token (or the end): its prefill is over
            if update.result is None:
                continue
            entry, choice = in_flight.pop(update.request_id)
            entry.results[choice] = update.result
            entry.left -= 1
            if not entry.left:
                done.append(entry.finished())
        if in_flight and not self.engine.has_unfinished():  # every request must end with a finished update
            for rid, (entry, _) in list(in_flight.items()):
                del in_flight[rid]
                window.leave(entry)
                entry.left -= 1
                if not entry.left:
                    done.append(entry.finished())
        return done
