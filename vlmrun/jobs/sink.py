"""Where caption records go: an append-only JSONL journal, resumable, and the outputs built on it.

Crash safety rests on one file format, the **journal**: one JSON record per line, each line
written by a single `os.write` on a file opened with O_APPEND, so a killed process leaves whole
lines (the kernel has them as soon as `write` returns) and at worst, after a power loss or a full
disk, a torn last line. The file is fsynced at most every `fsync_interval` seconds and at close
(a power loss can cost the last second of records, which a resume then redoes).

Opening a journal **repairs** it: a last line without its newline is cut off, and complete lines
that are not records are dropped (the file is rewritten through a temporary file and an atomic
rename). What remains is the set of recorded images, which `--resume` skips.

- **JSONL output** (`out.jsonl`): the journal is the output.
- **Parquet output** (`out.parquet`): records go to the journal `out.parquet.journal.jsonl`
  beside it while the job runs; when the job ends (finished, failed or interrupted, but not
  killed) the journal is converted to `out.parquet` (streamed in row groups, written to a
  temporary file, renamed over the output) and then deleted. A job resumed on a finished
  `out.parquet` first copies its rows into a new journal. Whenever the journal exists it holds
  every record (a kill between the rename and the delete leaves a journal equal to the
  output), so it alone says what is done.
- **Print output** (no `--out`): one line per image on stdout, nothing to resume.

A lock file `<out>.lock` (flock) stops two jobs from appending to the same output at once.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Optional, Protocol

from vlmrun.jobs.records import RECORD_FIELDS, CaptionRecord, arrow_schema, key_hash, record_key

try:  # POSIX only; elsewhere the lock is skipped
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
JOURNAL_SUFFIX = ".journal.jsonl"
PARQUET_ROW_GROUP = 10_000


class OutputError(Exception):
    """The output cannot be used (unknown format, locked by another job, unreadable)."""


class RecordSink(Protocol):
    def write(self, record: CaptionRecord) -> None: ...

    def close(self) -> None: ...


@dataclass
class ResumeState:
    """What an existing output already holds."""

    done: set[int] = field(default_factory=set)  # key hashes of recorded images
    ok: int = 0
    failed: int = 0
    dropped_lines: int = 0  # torn or invalid lines removed by the repair
    retried: int = 0  # error records removed for --retry-errors
    models: set[str] = field(default_factory=set)
    prompts: set[str] = field(default_factory=set)


def output_format(path: str) -> str:
    """"jsonl" or "parquet" from the file name; OutputError otherwise."""
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise OutputError(f"cannot tell the output format of {path!r}: name it *.jsonl or *.parquet")


def encode_record(record: dict[str, Any]) -> bytes:
    """One journal line. Text is kept as UTF-8; strings a UTF-8 encoder refuses (lone surrogates
    from undecodable file names) fall back to JSON escapes, so every line is valid JSON."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":")).encode("ascii") + b"\n"


# --------------------------------------------------------------------------------------------
# the journal


def _parse_line(line: bytes) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(value, dict) and isinstance(value.get("image"), str):
        return value
    return None


def iter_journal(path: str) -> Iterator[dict[str, Any]]:
    """The whole-line records of a journal (a torn last line and invalid lines are skipped)."""
    with open(path, "rb") as fh:
        for line in fh:
            if line.endswith(b"\n"):
                record = _parse_line(line)
                if record is not None:
                    yield record


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rewrite(path: str, records: Iterator[dict[str, Any]]) -> None:
    """Replace `path` atomically by a journal of `records`."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            for record in records:
                fh.write(encode_record(record))
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    _fsync_dir(path)


def _scan_records(records: Iterator[dict[str, Any]], retry_errors: bool,
                  state: Optional[ResumeState] = None) -> ResumeState:
    """Count `records` into `state` (error records left out with retry_errors)."""
    state = state if state is not None else ResumeState()
    for record in records:
        failed = record.get("error") is not None
        if failed and retry_errors:
            state.retried += 1
            continue
        h = key_hash(record_key(record))
        if h in state.done:  # never written twice by a job; tolerated if edited by hand
            continue
        state.done.add(h)
        state.ok += not failed
        state.failed += failed
        if isinstance(record.get("model"), str):
            state.models.add(record["model"])
        if isinstance(record.get("prompt"), str):
            state.prompts.add(record["prompt"])
    return state


def scan_journal(path: str, retry_errors: bool = False) -> ResumeState:
    """Repair the journal at `path` (if it exists) and return what it records.

    retry_errors: drop the error records, so that their images are captioned again."""
    state = ResumeState()
    if not os.path.exists(path):
        return state
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n") or _parse_line(line) is None:
                state.dropped_lines += 1
    _scan_records(iter_journal(path), retry_errors, state)
    if state.dropped_lines or state.retried:
        _rewrite(path, (r for r in iter_journal(path) if not (retry_errors and r.get("error") is not None)))
    return state


class Journal:
    """Appends records to a JSONL file: one write per line, fsync at most every interval."""

    def __init__(self, path: str, fsync_interval: float = 1.0, truncate: bool = False):
        self.path = path
        self.fsync_interval = fsync_interval
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        created = not os.path.exists(path)
        self._fd: Optional[int] = os.open(path, flags, 0o644)
        if created or truncate:
            os.fsync(self._fd)
            _fsync_dir(path)
        self._last_sync = time.monotonic()
        self._dirty = False

    def append(self, record: dict[str, Any]) -> None:
        assert self._fd is not None, "journal is closed"
        data = memoryview(encode_record(record))
        while data:  # a regular file takes it in one write; loop for the pathological case
            n = os.write(self._fd, data)
            data = data[n:]
        self._dirty = True
        if self.fsync_interval <= 0 or time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None


class _OutputLock:
    """An exclusive flock on `<out>.lock` for the life of the job."""

    def __init__(self, out: str):
        self.path = out + ".lock"
        self._fd: Optional[int] = None
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutputError(f"{out!r} is being written by another job (lock {self.path!r} is held)") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


# --------------------------------------------------------------------------------------------
# outputs


class JsonlOutput:
    """`out.jsonl`: the journal itself. Scanned (and repaired) when opened; the file is opened for
    appending (or truncated, with overwrite) at the first record, so a job that fails to start
    leaves it as it was."""

    def __init__(self, path: str, *, overwrite: bool = False, retry_errors: bool = False,
                 fsync_interval: float = 1.0):
        self.path = path
        self.overwrite = overwrite
        self.fsync_interval = fsync_interval
        self._journal: Optional[Journal] = None
        self._lock = _OutputLock(path)
        try:
            self.state = ResumeState() if overwrite else scan_journal(path, retry_errors)
        except BaseException:
            self._lock.release()
            raise

    def write(self, record: CaptionRecord) -> None:
        if self._journal is None:
            self._journal = Journal(self.path, self.fsync_interval, truncate=self.overwrite)
        self._journal.append(record.to_dict())

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
        self._lock.release()


class ParquetOutput:
    """`out.parquet`, built at the end from the journal `out.parquet.journal.jsonl`.

    State comes from the journal if there is one (a killed run), else from the Parquet file. At
    the first record the journal is started: emptied with overwrite, else seeded with the rows of
    an existing Parquet output (less the error rows with retry_errors)."""

    def __init__(self, path: str, *, overwrite: bool = False, retry_errors: bool = False,
                 fsync_interval: float = 1.0, row_group_size: int = PARQUET_ROW_GROUP):
        importlib.import_module("pyarrow.parquet")  # fail now, not at the end, if pyarrow is missing

        self.path = path
        self.journal_path = path + JOURNAL_SUFFIX
        self.overwrite = overwrite
        self.retry_errors = retry_errors
        self.fsync_interval = fsync_interval
        self.row_group_size = row_group_size
        self._journal: Optional[Journal] = None
        self._lock = _OutputLock(path)
        try:
            if overwrite:
                self.state = ResumeState()
            elif os.path.exists(self.journal_path):
                self.state = scan_journal(self.journal_path, retry_errors)
            else:
                self.state = _scan_records(_parquet_records(path), retry_errors) if os.path.exists(path) \
                    else ResumeState()
        except BaseException:
            self._lock.release()
            raise

    def write(self, record: CaptionRecord) -> None:
        if self._journal is None:
            self._start_journal()
        assert self._journal is not None
        self._journal.append(record.to_dict())

    def _start_journal(self) -> None:
        if self.overwrite:
            for p in (self.journal_path, self.path):
                if os.path.exists(p):
                    os.unlink(p)
        elif not os.path.exists(self.journal_path) and os.path.exists(self.path):
            keep = (r for r in _parquet_records(self.path) if not (self.retry_errors and r.get("error") is not None))
            _rewrite(self.journal_path, keep)
        self._journal = Journal(self.journal_path, self.fsync_interval)

    def close(self) -> None:
        try:
            if self._journal is not None:
                self._journal.close()
            if os.path.exists(self.journal_path):
                write_parquet(iter_journal(self.journal_path), self.path, self.row_group_size)
                os.unlink(self.journal_path)
                _fsync_dir(self.path)
        finally:
            self._lock.release()


class PrintOutput:
    """No --out: one line per image on a text stream (`path: 'caption'` or `path: ERROR ...`)."""

    def __init__(self, stream: Optional[IO[str]] = None):
        self.stream = stream if stream is not None else sys.stdout
        self.state = ResumeState()

    def write(self, record: CaptionRecord) -> None:
        text = f"ERROR {record.error}" if record.error is not None else repr(record.caption)
        print(f"{record.image}: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        self.stream.flush()


def open_output(path: Optional[str], *, overwrite: bool = False, retry_errors: bool = False,
                fsync_interval: float = 1.0, stream: Optional[IO[str]] = None) -> JsonlOutput | ParquetOutput | PrintOutput:
    """The output for `--out path` (None: print), repaired and scanned; `.state` says what is done."""
    if path is None:
        return PrintOutput(stream)
    kind = output_format(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"the folder of the output {path!r} does not exist")
    cls = JsonlOutput if kind == "jsonl" else ParquetOutput
    try:
        return cls(path, overwrite=overwrite, retry_errors=retry_errors, fsync_interval=fsync_interval)
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot use the output {path!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# parquet


def _parquet_records(path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise OutputError(f"cannot resume: {path!r} is not a readable Parquet file ({exc}); "
                          "use --overwrite or another --out") from None
    missing = [f for f in RECORD_FIELDS if f not in pf.schema_arrow.names]
    if "image" in missing:
        raise OutputError(f"cannot resume: {path!r} has no 'image' column; use --overwrite or another --out")
    for batch in pf.iter_batches(batch_size=PARQUET_ROW_GROUP):
        for row in batch.to_pylist():
            yield {f: row.get(f) for f in RECORD_FIELDS}


def write_parquet(records: Iterator[dict[str, Any]], path: str, row_group_size: int = PARQUET_ROW_GROUP) -> int:
    """Stream `records` into a Parquet file at `path` (through `path.tmp` and an atomic rename),
    one row group per `row_group_size` records, the first record of each image only. Returns the
    number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    tmp = path + ".tmp"
    seen: set[int] = set()
    rows = 0
    batch: list[dict[str, Any]] = []
    with pq.ParquetWriter(tmp, schema) as writer:
        def flush() -> None:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=row_group_size)
            batch.clear()

        for record in records:
            h = key_hash(record_key(record))
            if h in seen:
                continue
            seen.add(h)
            batch.append({f: record.get(f) for f in RECORD_FIELDS})
            rows += 1
            if len(batch) >= row_group_size:
                flush()
        if batch or rows == 0:
            flush()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)
    return rows
