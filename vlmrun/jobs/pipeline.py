"""The streaming caption pipeline: decode on a thread pool, generate on the engine, one record each.

    items ──feeder thread──▶ tasks (bounded) ──N worker threads: engine.process()──▶ ready (bounded)
          ──caller's thread: add_request / step──▶ on_record(item, record)

- The item iterator is consumed lazily by the feeder thread; `tasks` holds at most 2 items per
  worker and `ready` at most `prefetch` preprocessed prompts, so memory is bounded by
  (prefetch + workers + max_in_flight) images whatever the length of the job.
- Workers load the image (`vlmrun.processors.load_image`: read, validate, decode) and run
  `engine.process` (resize, patchify, tokenize): only the processor, which holds no engine state.
  Only the caller's thread calls `add_request`, `step` and `abort`; a record is made from the
  finished request's `RequestResult` that `step` hands out (`vlmrun/engine/outputs.py`).
- Before every step the engine is topped up from `ready` to `max_in_flight` requests (default
  the engine's `max_num_seqs`), so finished requests are replaced at once (continuous batching).
  While the engine has work the loop never blocks on `ready`; it waits on it only when the engine
  is idle.
- A bad image (or a prompt the engine refuses) becomes an error record; the job goes on. So does
  an output that does not complete the job's structured-output constraint (`parse_structured`).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from vlmrun.processors import InputError, ProcessedPrompt, load_image
from vlmrun.jobs.inputs import JobItem, is_video
from vlmrun.jobs.records import CaptionRecord, image_seed, parse_structured
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import SamplingParams

_POLL_S = 0.05  # how often blocked threads look at the stop flag
_STOP = object()  # tasks: no more items
_WORKER_DONE = object()  # ready: one worker has exited


@dataclass
class PipelineOptions:
    """prompt: the instruction given with every image; sampling: the per-request template
    (with a `seed`, each image draws from seed+image, see `image_seed`); model_name: what the
    records call the model; workers: preprocessing threads; prefetch: preprocessed prompts kept
    ready; max_in_flight: requests kept in the engine (None: its max_num_seqs)."""

    prompt: str
    sampling: SamplingParams
    model_name: str
    workers: int = 4
    prefetch: int = 64
    max_in_flight: Optional[int] = None
    lora: Optional[LoRARequest] = None  # the LoRA adapter every request runs with (None: the base model)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.sampling.n != 1:
            raise ValueError("a caption job makes one caption per image (SamplingParams.n must be 1)")


@dataclass
class _Prepared:
    item: JobItem
    prompt: Optional[ProcessedPrompt]
    error: Optional[str]
    preprocess_s: float


@dataclass
class _FeedError:
    exc: BaseException


@dataclass
class _InFlight:
    prepared: _Prepared
    added: float


OnRecord = Callable[[JobItem, CaptionRecord], None]


def describe_error(exc: BaseException) -> str:
    """The message an error record carries: InputError's own text, else `Type: message`."""
    if isinstance(exc, InputError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class CaptionPipeline:
    """Captions a stream of `JobItem`s on one `Engine` (see the module docstring).

    One pipeline may `run` many times in turn (a Ray actor runs it once per batch); runs never
    overlap."""

    def __init__(self, engine: Any, options: PipelineOptions):
        self.engine = engine
        self.options = options
        self.max_in_flight = options.max_in_flight or engine.config.max_num_seqs
        self._ids = itertools.count()

    # ------------------------------------------------------------------ public

    def run(self, items: Iterable[JobItem], on_record: OnRecord,
            on_tick: Optional[Callable[[], None]] = None) -> None:
        """Caption every item, calling `on_record` (in this thread) as each one finishes.

        Raises what the item iterator raised (after the records before it), or what the engine
        raised; in-flight requests are aborted then, so the engine can be used again."""
        stop = threading.Event()
        tasks: queue.Queue = queue.Queue(maxsize=2 * self.options.workers)
        ready: queue.Queue = queue.Queue(maxsize=self.options.prefetch)
        threads = [threading.Thread(target=self._feed, args=(items, tasks, ready, stop),
                                    name="vlmrun-caption-feeder", daemon=True)]
        threads += [threading.Thread(target=self._work, args=(tasks, ready, stop), name=f"vlmrun-caption-worker-{i}",
                                     daemon=True) for i in range(self.options.workers)]
        in_flight: dict[str, _InFlight] = {}
        for t in threads:
            t.start()
        try:
            self._drive(ready, in_flight, on_record, on_tick)
        finally:
            stop.set()
            for rid in list(in_flight):
                self.engine.abort(rid)
            _drain(ready)
            _drain(tasks)
            for t in threads:
                t.join(timeout=5.0)

    # ------------------------------------------------------------------ caller's thread

    def _drive(self, ready: queue.Queue, in_flight: dict[str, _InFlight], on_record: OnRecord,
               on_tick: Optional[Callable[[], None]]) -> None:
        workers_left = self.options.workers
        while True:
            while len(in_flight) < self.max_in_flight and workers_left:
                try:
                    msg = ready.get_nowait() if in_flight else ready.get(timeout=_POLL_S)
                except queue.Empty:
                    break
                if msg is _WORKER_DONE:
                    workers_left -= 1
                elif isinstance(msg, _FeedError):
                    raise msg.exc
                else:
                    self._admit(msg, in_flight, on_record)
            if in_flight:
                self._step(in_flight, on_record)
            elif not workers_left:
                return
            if on_tick is not None:
                on_tick()

    def _admit(self, prep: _Prepared, in_flight: dict[str, _InFlight], on_record: OnRecord) -> None:
        opts = self.options
        if prep.error is None:
            params = opts.sampling
            if params.seed is not None:
                params = dataclasses.replace(params, seed=image_seed(params.seed, prep.item.key))
            rid = f"caption-{next(self._ids)}"
            try:
                self.engine.add_request(rid, prep.prompt, params, lora_request=opts.lora)
                in_flight[rid] = _InFlight(prep, time.monotonic())
                return
            except (InputError, ValueError) as exc:
                prep.error = describe_error(exc)
        on_record(prep.item, CaptionRecord.failure(prep.item.key, opts.model_name, opts.prompt, prep.error,
                                                   prep.preprocess_s))

    def _step(self, in_flight: dict[str, _InFlight], on_record: OnRecord) -> None:
        finished = {u.request_id: u.result for u in self.engine.step() if u.finished and u.request_id in in_flight}
        if not self.engine.has_unfinished():  # every request must end with a finished update
            finished.update({rid: None for rid in in_flight if rid not in finished})
        now = time.monotonic()
        opts = self.options
        for rid, result in finished.items():
            entry = in_flight.pop(rid)
            prep = entry.prepared
            if result is None:
                record = CaptionRecord.failure(prep.item.key, opts.model_name, opts.prompt,
                                               "the engine dropped the request", prep.preprocess_s)
            else:
                parsed, error = None, None
                spec = opts.sampling.structured_outputs
                if spec is not None:
                    parsed, error = parse_structured(spec, result.text, result.grammar_ended, result.finish_reason)
                record = CaptionRecord(image=prep.item.key, caption=result.text, num_tokens=result.num_output_tokens,
                                       model=opts.model_name, prompt=opts.prompt, error=error,
                                       finish_reason=result.finish_reason, preprocess_s=round(prep.preprocess_s, 6),
                                       generate_s=round(now - entry.added, 6), parsed=parsed)
            on_record(prep.item, record)

    # ------------------------------------------------------------------ threads

    def _feed(self, items: Iterable[JobItem], tasks: queue.Queue, ready: queue.Queue,
              stop: threading.Event) -> None:
        try:
            for item in items:
                if not _put(tasks, item, stop):
                    return
        except BaseException as exc:  # a manifest that fails mid-way: surface it in the caller
            _put(ready, _FeedError(exc), stop)
        for _ in range(self.options.workers):
            if not _put(tasks, _STOP, stop):
                return

    def _work(self, tasks: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        # Torch's OpenMP thread count is per calling thread: one each here, so preprocessing
        # threads never start OpenMP teams that spin on the cores the engine's step needs.
        torch.set_num_threads(1)
        while not stop.is_set():
            try:
                item = tasks.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _STOP:
                _put(ready, _WORKER_DONE, stop)
                return
            if not _put(ready, self._prepare(item), stop):
                return

    def _prepare(self, item: JobItem) -> _Prepared:
        start = time.perf_counter()
        if item.error is not None:
            return _Prepared(item, None, item.error, 0.0)
        try:
            if is_video(item.source):  # one record per video
                prompt = self.engine.process({"prompt": self.options.prompt, "videos": [item.source]})
                return _Prepared(item, prompt, None, time.perf_counter() - start)
            # Loaded here first so that a bad file's error names the file plainly (the processor
            # would prefix "image 1 (...)"); the decoded RGB image then goes through the processor.
            image = load_image(item.source, self.engine.processor.limits)
            prompt = self.engine.process({"prompt": self.options.prompt, "images": [image]})
            return _Prepared(item, prompt, None, time.perf_counter() - start)
        except Exception as exc:  # any failure of one image is that image's record, never the job's end
            return _Prepared(item, None, describe_error(exc), time.perf_counter() - start)


def _put(q: queue.Queue, value: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up (False) once `stop` is set."""
    while not stop.is_set():
        try:
            q.put(value, timeout=_POLL_S)
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
