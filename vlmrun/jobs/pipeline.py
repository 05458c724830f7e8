"""The caption job's use of the input pipeline: one record per image (or video), as each finishes.

    JobItems ──vlmrun.feed.InputPipeline (feeder + worker threads: load + engine.process, `prefetch`
        ahead; the engine topped up and stepped on the caller's thread)──▶ on_record(item, record)

The pipeline is the one behind `LLM.generate` (`vlmrun/feed/pipeline.py`): inputs read lazily, at
most `prefetch` preprocessed prompts ahead of the engine and `max_in_flight` requests in it (default
the engine's `max_num_seqs`), so memory is bounded whatever the length of the job. What is the job's
own is here: how an item is loaded (`_prepare_item`: a bad file's error names the file), its
sampling (with a seed, each image draws from seed+image, `image_seed`) and its record, made from the
finished request's `RequestResult` (`vlmrun/engine/outputs.py`).

A bad image (or a prompt the engine refuses) becomes an error record; the job goes on. So does an
output that does not complete the job's structured-output constraint (`parse_structured`).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from vlmrun.feed.pipeline import DEFAULT_PREFETCH, Finished, InputPipeline, Work
from vlmrun.feed.prefetch import describe_error
from vlmrun.feed.workers import preprocess_workers
from vlmrun.processors import InputError, ProcessedPrompt, load_image
from vlmrun.jobs.inputs import JobItem, is_video
from vlmrun.jobs.records import CaptionRecord, image_seed, parse_structured
from vlmrun.lora.request import LoRARequest
from vlmrun.sampling_params import SamplingParams

__all__ = ["CaptionPipeline", "PipelineOptions", "describe_error"]

SLOW_PREPROCESS_S = 5.0  # an input whose preprocessing alone takes this long is reported (`slow_inputs`)


@dataclass
class PipelineOptions:
    """prompt: the instruction given with every image; sampling: the per-request template
    (with a `seed`, each image draws from seed+image, see `image_seed`); model_name: what the
    records call the model; workers: preprocessing threads (None: the usable CPUs, at most 8);
    prefetch: preprocessed prompts kept ready; max_in_flight: requests kept in the engine (None:
    its max_num_seqs)."""

    prompt: str
    sampling: SamplingParams
    model_name: str
    workers: Optional[int] = None
    prefetch: int = DEFAULT_PREFETCH
    max_in_flight: Optional[int] = None
    lora: Optional[LoRARequest] = None  # the LoRA adapter every request runs with (None: the base model)

    def __post_init__(self) -> None:
        if self.workers is None:
            self.workers = preprocess_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.sampling.n != 1:
            raise ValueError("a caption job makes one caption per image (SamplingParams.n must be 1)")


OnRecord = Callable[[JobItem, CaptionRecord], None]


class CaptionPipeline:
    """Captions a stream of `JobItem`s on one `Engine` (see the module docstring).

    One pipeline may `run` many times in turn (a Ray actor runs it once per batch); runs never
    overlap. `preprocessed`: inputs preprocessed by the current run (progress); `slow_inputs`: (key,
    seconds) of each input whose preprocessing took `SLOW_PREPROCESS_S` or more, put by the workers as
    it happens, for the caller to report."""

    def __init__(self, engine: Any, options: PipelineOptions):
        self.engine = engine
        self.options = options
        self.inputs = InputPipeline(engine, self._prepare_item, workers=options.workers, prefetch=options.prefetch,
                                    max_in_flight=options.max_in_flight)
        self.max_in_flight = self.inputs.max_in_flight
        self.slow_inputs: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self._ids = itertools.count()

    @property
    def preprocessed(self) -> int:
        return self.inputs.preprocessed

    def run(self, items: Iterable[JobItem], on_record: OnRecord,
            on_tick: Optional[Callable[[], None]] = None) -> None:
        """Caption every item, calling `on_record` (in this thread) as each one finishes.

        Raises what the item iterator raised (after the records before it), or what the engine
        raised; in-flight requests are aborted then, so the engine can be used again."""
        for finished in self.inputs.stream(self._works(items), on_tick=on_tick):
            on_record(finished.work.source, self._record(finished))

    def _works(self, items: Iterable[JobItem]) -> Iterator[Work]:
        opts = self.options
        for item in items:
            params = opts.sampling
            if params.seed is not None:
                params = dataclasses.replace(params, seed=image_seed(params.seed, item.key))
            yield Work(f"caption-{next(self._ids)}", item, [params], opts.lora)

    def _prepare_item(self, item: JobItem) -> ProcessedPrompt:
        """In a worker thread: the item's prompt (InputError naming what is wrong with it)."""
        start = time.perf_counter()
        try:
            return self._prompt_of(item)
        finally:
            seconds = time.perf_counter() - start
            if seconds >= SLOW_PREPROCESS_S:
                self.slow_inputs.put((item.key, seconds))

    def _prompt_of(self, item: JobItem) -> ProcessedPrompt:
        if item.error is not None:
            raise InputError(item.error)
        if is_video(item.source):  # one record per video
            return self.engine.process({"prompt": self.options.prompt, "videos": [item.source]})
        # Loaded here first so that a bad file's error names the file plainly (the processor
        # would prefix "image 1 (...)"); the decoded RGB image then goes through the processor.
        image = load_image(item.source, self.engine.processor.limits)
        return self.engine.process({"prompt": self.options.prompt, "images": [image]})

    def _record(self, finished: Finished) -> CaptionRecord:
        opts = self.options
        item: JobItem = finished.work.source
        preprocess_s = 0.0 if item.error is not None else finished.preprocess_s
        result = finished.results[0]
        if finished.error is not None or result is None:
            error = finished.error if finished.error is not None else "the engine dropped the request"
            return CaptionRecord.failure(item.key, opts.model_name, opts.prompt, error, preprocess_s)
        parsed, error = None, None
        spec = opts.sampling.structured_outputs
        if spec is not None:
            parsed, error = parse_structured(spec, result.text, result.grammar_ended, result.finish_reason)
        return CaptionRecord(image=item.key, caption=result.text, num_tokens=result.num_output_tokens,
                             model=opts.model_name, prompt=opts.prompt, error=error,
                             finish_reason=result.finish_reason, preprocess_s=round(preprocess_s, 6),
                             generate_s=round(finished.generate_s, 6), parsed=parsed)
