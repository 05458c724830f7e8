"""Running a caption job end to end: output and resume, inputs, engine (or Ray), progress, summary.

`run_caption_job(config)` is what `vlmrun caption` calls; it returns a `JobSummary` whose
`exit_code()` is the command's status. The engine is built only when there is something to
caption, and only this thread touches it.
"""

from __future__ import annotations

import glob
import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Protocol

from vlmrun.jobs.config import CaptionJobConfig
from vlmrun.jobs.inputs import InputStats, JobItem, count_new, is_url, is_video, iter_items, new_items
from vlmrun.jobs.embed_pipeline import EmbedPipeline
from vlmrun.jobs.embed_records import EMBEDDING_SCHEMA
from vlmrun.jobs.pipeline import CaptionPipeline, PipelineOptions
from vlmrun.jobs.progress import JobCounters, JobSummary, ProgressBar
from vlmrun.jobs.records import CAPTION_SCHEMA, CaptionRecord
from vlmrun.jobs.journal import ResumeState
from vlmrun.jobs.sink import JOURNAL_SUFFIX, STDOUT, OutputError, open_output
from vlmrun.lora.request import LoRARequest


MAX_SLOW_WARNINGS = 5  # slow-preprocessing warnings printed per job


class NoInputsError(ValueError):
    """The inputs name no image at all, or name a path that does not exist."""


class OutputWriteError(Exception):
    """A record could not be written (the job stops; its summary says why)."""


class JobOutcome(Protocol):
    interrupted: bool
    output_error: Optional[str]


@contextmanager
def ending_cleanly(sink: Any, summary: JobOutcome, out: Optional[str]) -> Iterator[None]:
    """The body of a job writing to `sink` (caption, run-batch): a Ctrl-C or an output that cannot be
    written ends it, keeping what was written (`summary.interrupted` / `.output_error` say why), and
    the sink is closed in every case (a failed close, an fsync or the Parquet conversion, is an output
    error too)."""
    try:
        yield
    except KeyboardInterrupt:
        summary.interrupted = True
    except OutputWriteError as exc:
        summary.output_error = str(exc)
    finally:
        try:
            sink.close()
        except OSError as exc:
            summary.output_error = summary.output_error or f"cannot finish the output {out!r}: {exc}"


def run_caption_job(config: CaptionJobConfig, stdout: Optional[IO[str]] = None,
                    stderr: Optional[IO[str]] = None) -> JobSummary:
    """Caption every input of `config` not yet in its output; write records as they finish.

    Raises NoInputsError when the inputs name no image, OutputError for an unusable output and
    whatever building the engine raises; a KeyboardInterrupt ends the job cleanly (records kept,
    summary.interrupted set). stdout / stderr: default sys.stdout / sys.stderr at call time."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    _refuse_missing_inputs(config.inputs)
    _refuse_an_input_as_output(config)
    sink = open_output(config.out, overwrite=config.overwrite, retry_errors=config.retry_errors,
                       fsync_interval=config.fsync_interval, stream=stdout,
                       schema=CAPTION_SCHEMA if config.pooling is None else EMBEDDING_SCHEMA)
    state = sink.state
    _warn_if_mixed(state, config, stderr)
    stats = InputStats()
    counters = JobCounters()
    summary = JobSummary(prior_failed=state.failed, out=config.out,
                         verb=("caption", "captioned") if config.pooling is None else ("embed", "embedded"))
    bar = ProgressBar(counters, stderr, enabled=config.progress and config.out not in (None, STDOUT))
    done = state.done  # read-only from here on (the input filter and the counting thread read it)

    def on_record(item: JobItem, record: CaptionRecord) -> None:
        record.kind = "video" if is_video(item.source if item.source is not None else item.key) else "image"
        record.columns = item.columns
        try:
            sink.write(record)
        except OSError as exc:  # disk full, a vanished folder: the job stops, what was written stays
            raise OutputWriteError(f"cannot write the output {config.out or 'stdout'!r}: {exc}") from exc
        counters.count(record.error is not None, record.num_tokens, record.kind == "video", record.image, record.error)
        bar.refresh()

    with ending_cleanly(sink, summary, config.out):
        try:
            items = new_items(iter_items(config.inputs, config.image_column, stats), done, stats)
            first = next(items, None)  # in this thread: nothing to do means no engine is built
            if first is None:
                if not (stats.skipped_done or stats.duplicates):
                    raise NoInputsError(f"no images found in {' '.join(config.inputs)}")
            else:
                _count_in_background(config, done, counters)
                _run(config, itertools.chain([first], items), counters, on_record, bar)
        finally:
            bar.close()
    summary.written, summary.failed, summary.tokens = counters.done, counters.failed, counters.tokens
    summary.videos, summary.spec_decode, summary.failures = counters.videos, counters.spec_decode, counters.failures
    summary.elapsed_s = counters.elapsed() if counters.done else 0.0
    summary.skipped_done, summary.duplicates, summary.ignored_files = (stats.skipped_done, stats.duplicates,
                                                                       stats.ignored_files)
    return summary


def _run(config: CaptionJobConfig, items: Iterator[JobItem], counters: JobCounters, on_record, bar: ProgressBar) -> None:
    if config.ray is not None:
        from vlmrun.jobs.ray_data import run_ray_job

        def start() -> None:
            counters.started = time.monotonic()

        run_ray_job(config, items, on_record, on_tick=bar.refresh, on_start=start)
        return
    from vlmrun.config import EngineConfig
    from vlmrun.engine.engine import Engine
    from vlmrun.loading_line import loading_line

    with loading_line(config.model or "the bundled default model"):
        engine = Engine(EngineConfig(model=config.model, **config.engine_options))
    engine.compile_structured(config.sampling)  # a bad --json-schema / --regex ends the job before it starts
    lora = None if config.lora is None else LoRARequest(Path(config.lora).name, 1, config.lora)
    if lora is not None:
        engine.executor.add_lora(lora)  # a bad adapter ends the job before it starts
    options = PipelineOptions(prompt=config.prompt, sampling=config.sampling, model_name=config.model,
                              workers=config.workers, prefetch=config.prefetch, lora=lora)
    pipeline = (CaptionPipeline(engine, options) if config.pooling is None  # `vlmrun embed`: a vector per image
                else EmbedPipeline(engine, options, config.pooling))
    slow_reported = [0]

    def tick() -> None:
        counters.preprocessed = pipeline.preprocessed
        while not pipeline.slow_inputs.empty():
            key, seconds = pipeline.slow_inputs.get()
            slow_reported[0] += 1
            if slow_reported[0] <= MAX_SLOW_WARNINGS:
                bar.note(f"warning: preprocessing {key} alone took {seconds:.1f}s (a very large image? "
                         f"--max-image-pixels refuses those)"
                         + ("; further slow inputs are not reported" if slow_reported[0] == MAX_SLOW_WARNINGS else ""))
        bar.refresh()

    counters.started = time.monotonic()
    try:
        pipeline.run(items, lambda item, record: (tick(), on_record(item, record)), on_tick=tick)
    finally:
        counters.spec_decode = engine.stats().spec_decode  # (None when the engine does not speculate)
        engine.shutdown()  # tensor-parallel rank processes, if any


def _refuse_missing_inputs(specs: list[str]) -> None:
    """NoInputsError naming an INPUT that is neither a URL, nor an existing path, nor a glob matching
    something: a typo is said at once, before the output is opened or the model loaded."""
    for spec in specs:
        if is_url(spec) or os.path.exists(spec):
            continue
        if glob.has_magic(spec):
            if next(glob.iglob(spec, recursive=True), None) is None:
                raise NoInputsError(f"no file matches {spec!r}")
            continue
        raise NoInputsError(f"no such file or folder: {spec!r}")


def _refuse_an_input_as_output(config: CaptionJobConfig) -> None:
    """OutputError when `--out` (or a Parquet output's journal) is one of the input files: writing
    it would destroy the manifest the job reads."""
    if config.out in (None, STDOUT):
        return
    outputs = [path for path in (config.out, config.out + JOURNAL_SUFFIX) if os.path.isfile(path)]
    for spec in config.inputs:
        if os.path.isfile(spec) and any(os.path.samefile(spec, path) for path in outputs):
            raise OutputError(f"--out {config.out!r} is one of the inputs ({spec!r}); it is left untouched")


def _count_in_background(config: CaptionJobConfig, done: set[int], counters: JobCounters) -> None:
    """Set counters.total once the inputs are counted (a second, cheap pass: no image is read)."""
    def count() -> None:
        try:
            counters.total = count_new(config.inputs, done, config.image_column)
        except Exception:  # the job itself reports unreadable inputs; the bar just has no total
            pass

    threading.Thread(target=count, name="vlmrun-caption-count", daemon=True).start()


def _warn_if_mixed(state: ResumeState, config: CaptionJobConfig, stderr: IO[str]) -> None:
    if state.dropped_lines:
        print(f"note: removed the torn last record line from {config.out} (a crash mid-write); "
              "its image is captioned again", file=stderr)
    others = [f"model {m!r}" for m in state.models - {config.model}]
    others += [f"prompt {p!r}" for p in state.prompts - {config.prompt}]
    if others:
        print(f"warning: {config.out} already holds records made with {', '.join(others)}; they are kept "
              "(use --overwrite to start afresh)", file=stderr)
