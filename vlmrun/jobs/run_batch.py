"""Running a `vlmrun run-batch` job: OpenAI batch JSONL in, one answer line per request out, resumably.

    input lines ──bounded_lines, read_line──▶ refusals / requests ──InProcessServer.post (asyncio)──▶
        answers ──ReorderWindow (`max_in_flight` lines)──▶ output lines in input order, appended to the journal

- Output in input order (vLLM's), streaming with bounded memory: a line is written as soon as it and
  every line before it are answered, so it waits only for earlier lines still in flight. At most
  `max_in_flight` lines (default twice the engine's `max_num_seqs`, as vLLM) are sent or waiting to be
  written (the window, `vlmrun.feed.reorder`), so the engine batches them continuously and a slow line
  holds back the reading, not the memory; nothing but the set of keys seen is kept per line.
- A line is read up to its cap (the server's `max_request_bytes` plus the envelope,
  `run_batch_reader`): a longer one is answered 413 without being read whole.
- Exactly once: the output is the crash-safe journal of `vlmrun caption` (`journal.py`, `sink.py`) with
  batch lines (`run_batch_lines.BATCH_LINES`): a rerun with the same output skips the keys already there,
  a torn last line is cut, a file that is not a batch output is refused untouched.
- The engine is built only when a request is left to send.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import IO, Callable, Iterator, Optional, Union

from vlmrun.config import EngineConfig
from vlmrun.jobs.journal import ResumeState
from vlmrun.jobs.records import key_hash
from vlmrun.jobs.run_batch_lines import (
    BATCH_LINES,
    BatchOutputLine,
    BatchRequest,
    Refusal,
    custom_id_key,
    item_key,
    read_line,
)
from vlmrun.jobs.run_batch_reader import ENVELOPE_BYTES, LongLine, bounded_lines, line_cap
from vlmrun.jobs.run_batch_server import InProcessServer
from vlmrun.jobs.runner import OutputWriteError, ending_cleanly
from vlmrun.jobs.sink import STDOUT, JsonlOutput, OutputError, PrintOutput
from vlmrun.feed.reorder import ReorderWindow
from vlmrun.server.errors import APIError, bad_request, internal
from vlmrun.server.settings import ServerSettings

_RETRY_S = 0.05  # wait before sending again a request the server's full queue refused (429)


@dataclass
class RunBatchConfig:
    """Everything `vlmrun run-batch` was asked to do.

    out: the output JSONL file (any name), or None / "-" for JSONL on stdout (nothing to resume).
    max_in_flight: lines sent and not yet written (None: 2 x the engine's max_num_seqs); a line is written
    once the lines before it are, so this bounds what waits.
    overwrite: start `out` afresh; retry_errors: on resume, send again the lines whose answer failed."""

    input: str
    engine: EngineConfig
    settings: ServerSettings
    out: Optional[str] = None
    max_in_flight: Optional[int] = None
    overwrite: bool = False
    retry_errors: bool = False
    fsync_interval: float = 1.0


@dataclass
class BatchSummary:
    """The outcome of a run, for the final report and the exit status."""

    written: int = 0  # output lines written by this run
    failed: int = 0  # of which errors
    tokens: int = 0  # completion tokens of the answers
    elapsed_s: float = 0.0
    skipped_done: int = 0  # lines already in the output
    prior_failed: int = 0  # error lines already in the output (and kept)
    interrupted: bool = False
    out: Optional[str] = None
    output_error: Optional[str] = None

    def exit_code(self) -> int:
        """Of this run: 0 every line was written, errors included (vLLM's: a failed request is its error
        line); 1 the output could not be written; 130 interrupted."""
        if self.interrupted:
            return 130
        return 1 if self.output_error else 0

    def lines(self) -> list[str]:
        rate = self.written / self.elapsed_s if self.elapsed_s > 0 else 0.0
        token_rate = self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        if self.written or not self.skipped_done:
            out = [f"answered {self.written - self.failed:,}/{self.written:,} requests in {self.elapsed_s:.2f}s "
                   f"({rate:.2f} requests/s, {token_rate:.1f} tokens/s), {self.failed:,} failed"]
        else:
            out = ["nothing left to run"]
        notes = []
        if self.skipped_done:
            notes.append(f"{self.skipped_done:,} lines already in the output (skipped)")
        if self.prior_failed:
            notes.append(f"{self.prior_failed:,} earlier failures kept (--retry-errors sends them again)")
        if notes:
            out.append("; ".join(notes))
        if self.output_error:
            out.append(f"stopped: {self.output_error}; the {self.written:,} lines before it are kept: "
                       "free the space and run the same command again to resume")
        elif self.interrupted:
            out.append("interrupted: run the same command again to resume")
        elif self.out not in (None, STDOUT):
            out.append(f"answers in {self.out}")
        return out


Item = Union[BatchRequest, Refusal]


def run_batch_job(config: RunBatchConfig, stdout: Optional[IO[str]] = None,
                  stderr: Optional[IO[str]] = None) -> BatchSummary:
    """Answer every line of `config.input` not yet in its output, writing lines in input order.

    Raises OutputError for an unusable output (not a batch output, locked, the input itself), OSError
    for an unreadable input and whatever building the engine raises; a KeyboardInterrupt ends the
    job cleanly (lines kept, summary.interrupted set)."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    sink = _open_output(config, stdout)
    summary = BatchSummary(prior_failed=sink.state.failed, out=config.out)
    if sink.state.dropped_lines:
        print(f"note: removed the torn last line from {config.out} (a crash mid-write); its request is sent again",
              file=stderr)
    started = time.monotonic()

    def write(line: BatchOutputLine) -> None:
        try:
            sink.write(line)
        except OSError as exc:  # disk full, a vanished folder: the job stops, what was written stays
            raise OutputWriteError(f"cannot write the output {config.out or 'stdout'!r}: {exc}") from exc
        summary.written += 1
        summary.failed += line.failed
        summary.tokens += line.num_tokens

    with ending_cleanly(sink, summary, config.out), open(config.input, "rb") as fh:
        items = _new_items(fh, sink.state, summary, line_cap(config.settings.max_request_bytes))
        first = _write_refusals_until_a_request(items, write)
        if first is not None:
            _answer_requests(config, first, items, write)
    summary.elapsed_s = time.monotonic() - started
    return summary


def _open_output(config: RunBatchConfig, stdout: IO[str]) -> Union[JsonlOutput, PrintOutput]:
    if config.out in (None, STDOUT):
        return PrintOutput(stdout, jsonl=True)
    if os.path.exists(config.out) and os.path.samefile(config.input, config.out):
        raise OutputError(f"the output {config.out!r} is the input; it is left untouched")
    if not os.path.isdir(os.path.dirname(os.path.abspath(config.out))):
        raise OutputError(f"the folder of the output {config.out!r} does not exist")
    try:
        return JsonlOutput(config.out, overwrite=config.overwrite, retry_errors=config.retry_errors,
                           fsync_interval=config.fsync_interval, fmt=BATCH_LINES)
    except OSError as exc:
        raise OutputError(f"cannot use the output {config.out!r}: {exc}") from exc


def _new_items(lines: IO[bytes], done: ResumeState, summary: BatchSummary, cap: int) -> Iterator[Item]:
    """The input's lines still to answer: requests, and refusals (a repeated custom_id, a line over `cap`
    bytes among them)."""
    seen: set[int] = set()  # custom_id keys met in the input so far
    for number, raw in bounded_lines(lines, cap):
        if isinstance(raw, LongLine):
            item: Item = Refusal(number, None, APIError(
                413, f"line {number} is {raw.size:,} bytes, longer than the {cap:,} a batch line may have "
                     f"(--max-request-mb plus {ENVELOPE_BYTES >> 10} KiB for its envelope); it was not read",
                code="request_too_large"), keyed_by_line=True)
        elif not raw.strip():
            continue
        else:
            item = read_line(raw, number)
        if item.custom_id is not None and not (isinstance(item, Refusal) and item.keyed_by_line):
            h = key_hash(custom_id_key(item.custom_id))
            if h in seen:
                item = Refusal(number, item.custom_id, bad_request(
                    f"custom_id {item.custom_id!r} is used by an earlier line; each request needs its own",
                    param="custom_id"), keyed_by_line=True)
            seen.add(h)
        if key_hash(item_key(item)) in done.done:
            summary.skipped_done += 1
            continue
        yield item


def _write_refusals_until_a_request(items: Iterator[Item], write: Callable[[BatchOutputLine], None]) -> Optional[
        BatchRequest]:
    """Write the refusals before the first request; that request (None: there is none)."""
    for item in items:
        if isinstance(item, BatchRequest):
            return item
        write(BatchOutputLine.refusal(item))
    return None


def _answer_requests(config: RunBatchConfig, first: BatchRequest, items: Iterator[Item],
                     write: Callable[[BatchOutputLine], None]) -> None:
    """Build the engine and the in-process server, and answer `first` and the rest of `items`."""
    from vlmrun.server.launch import build_engine

    engine = build_engine(config.engine)
    server = InProcessServer(engine, config.settings)
    limit = config.max_in_flight or 2 * config.engine.max_num_seqs
    try:
        asyncio.run(_send_all(server, first, items, write, limit))
    finally:
        server.close()
        engine.shutdown()


async def _send_all(server: InProcessServer, first: BatchRequest, items: Iterator[Item], write: Callable[[BatchOutputLine], None],
                    limit: int) -> None:
    """Send the requests, at most `limit` lines open at a time; write the lines in input order."""
    window: ReorderWindow[BatchOutputLine] = ReorderWindow(limit)
    pending: dict[asyncio.Task, int] = {}  # request -> its slot in the window

    def send(request: BatchRequest) -> None:
        pending[asyncio.create_task(_answer(server, request))] = window.open()

    async def answered() -> None:
        """Wait for at least one answer; write what is now in order."""
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            window.close(pending.pop(task), task.result())
        for line in window.released():
            write(line)

    try:
        send(first)
        for item in items:
            while window.full:
                await answered()
            if isinstance(item, Refusal):
                window.close(window.open(), BatchOutputLine.refusal(item))
                for line in window.released():
                    write(line)
            else:
                send(item)
        while pending:
            await answered()
    finally:
        for task in pending:
            task.cancel()  # the server's handlers abort their engine requests
        if pending:
            await asyncio.wait(pending)


async def _answer(server: InProcessServer, request: BatchRequest) -> BatchOutputLine:
    body = json.dumps(request.body).encode("ascii")
    while True:
        try:
            answer = await server.post(request.url, body)
        except Exception as exc:  # the app answers its own errors; this would be a bug: one line's error
            return BatchOutputLine.answer(request.custom_id, 500, internal(f"{type(exc).__name__}: {exc}").body())
        if answer.status != 429:  # a full queue is the job's own doing: send it again once there is room
            return BatchOutputLine.answer(request.custom_id, answer.status, answer.body)
        await asyncio.sleep(_RETRY_S)
