"""Where caption records go: the outputs, built on the crash-safe JSONL journal (`journal.py`).

Opening an output scans (and repairs) its journal; `.state` says which images are done, and
`--resume` skips them.

- **JSONL output** (`out.jsonl`): the journal is the output.
- **Parquet output** (`out.parquet`): records go to the journal `out.parquet.journal.jsonl`
  beside it while the job runs; when the job ends (finished, failed or interrupted, but not
  killed) the journal is converted to `out.parquet` (streamed in row groups, written to a
  temporary file, renamed over the output) and then deleted. A job resumed on a finished
  `out.parquet` first copies its rows into a new journal. Whenever the journal exists it holds
  every record (a kill between the rename and the delete leaves a journal equal to the
  output), so it alone says what is done.
- **Print output** (no `--out`): one line per image on stdout, nothing to resume.

`vlmrun run-batch` writes its lines through the same JSONL and print outputs (any object with
`to_dict()` is a record; the journal's `RecordFormat` says what its lines are).

A lock file `<out>.lock` (flock) stops two jobs from appending to the same output at once.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import IO, Any, Iterator, Optional, Protocol

from vlmrun.jobs.journal import (
    CAPTION_RECORDS,
    Journal,
    RecordFormat,
    ResumeState,
    encode_record,
    fsync_dir,
    iter_journal,
    rewrite_journal,
    scan_journal,
    scan_records,
)
from vlmrun.jobs.records import CAPTION_SCHEMA, CaptionRecord, RecordSchema, key_hash, record_key

try:  # POSIX only; elsewhere the lock is skipped
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
JOURNAL_SUFFIX = ".journal.jsonl"
STDOUT = "-"  # --out -: JSONL records on standard output
PARQUET_ROW_GROUP = 10_000


class Record(Protocol):
    """What an output writes: a caption record, a batch output line."""

    def to_dict(self) -> dict[str, Any]: ...


class OutputError(Exception):
    """The output cannot be used (unknown format, locked by another job, unreadable)."""


def output_format(path: str) -> str:
    """"jsonl" or "parquet" from the file name; OutputError otherwise."""
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise OutputError(f"cannot tell the output format of {path!r}: name it *.jsonl or *.parquet")


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
                 fsync_interval: float = 1.0, fmt: RecordFormat = CAPTION_RECORDS):
        self.path = path
        self.overwrite = overwrite
        self.fsync_interval = fsync_interval
        self._journal: Optional[Journal] = None
        self._lock = _OutputLock(path)
        try:
            self.state = ResumeState() if overwrite else scan_journal(path, retry_errors, fmt)
        except BaseException:
            self._lock.release()
            raise

    def write(self, record: Record) -> None:
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
                 fsync_interval: float = 1.0, row_group_size: int = PARQUET_ROW_GROUP,
                 schema: RecordSchema = CAPTION_SCHEMA):
        importlib.import_module("pyarrow.parquet")  # fail now, not at the end, if pyarrow is missing

        self.path = path
        self.schema = schema  # the records' columns (the embedding job's add its vector)
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
                self.state = scan_records(_parquet_records(path, schema), retry_errors) if os.path.exists(path) \
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
            keep = (r for r in _parquet_records(self.path, self.schema) if not (self.retry_errors and r.get("error") is not None))
            rewrite_journal(self.journal_path, keep)
        self._journal = Journal(self.journal_path, self.fsync_interval)

    def close(self) -> None:
        try:
            if self._journal is not None:
                self._journal.close()
            if os.path.exists(self.journal_path):
                write_parquet(iter_journal(self.journal_path), self.path, self.row_group_size, self.schema)
                os.unlink(self.journal_path)
                fsync_dir(self.path)
        finally:
            self._lock.release()


class PrintOutput:
    """`--out -`, or no --out with stdout not a terminal (a pipe, a file): one JSONL record per line, as
    in a .jsonl output. No --out on a terminal: one line per image for a person to read
    (`path: 'caption'` or `path: ERROR ...`)."""

    def __init__(self, stream: Optional[IO[str]] = None, jsonl: bool = False):
        self.stream = stream if stream is not None else sys.stdout
        self.jsonl = jsonl
        self.state = ResumeState()

    def write(self, record: Record) -> None:
        if self.jsonl:
            self.stream.write(encode_record(record.to_dict()).decode("utf-8"))
            self.stream.flush()
            return
        text = f"ERROR {record.error}" if record.error is not None else repr(record.caption)
        print(f"{record.image}: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        self.stream.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def open_output(path: Optional[str], *, overwrite: bool = False, retry_errors: bool = False,
                fsync_interval: float = 1.0, stream: Optional[IO[str]] = None,
                schema: RecordSchema = CAPTION_SCHEMA) -> JsonlOutput | ParquetOutput | PrintOutput:
    """The output for `--out path` (None: print; "-": JSONL on `stream`), repaired and scanned; `.state`
    says what is done. `schema`: the Parquet columns of the records."""
    if path is None or path == STDOUT:
        stream = stream if stream is not None else sys.stdout
        return PrintOutput(stream, jsonl=path == STDOUT or not _is_terminal(stream))
    kind = output_format(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"the folder of the output {path!r} does not exist")
    try:
        if kind == "parquet":
            return ParquetOutput(path, overwrite=overwrite, retry_errors=retry_errors, fsync_interval=fsync_interval,
                                 schema=schema)
        return JsonlOutput(path, overwrite=overwrite, retry_errors=retry_errors, fsync_interval=fsync_interval)
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot use the output {path!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# parquet


def _parquet_records(path: str, schema: RecordSchema = CAPTION_SCHEMA) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise OutputError(f"cannot resume: {path!r} is not a readable Parquet file ({exc}); "
                          "use --overwrite or another --out") from None
    missing = [f for f in schema.fields if f not in pf.schema_arrow.names]
    if "image" in missing:
        raise OutputError(f"cannot resume: {path!r} has no 'image' column; use --overwrite or another --out")
    for batch in pf.iter_batches(batch_size=PARQUET_ROW_GROUP):
        for row in batch.to_pylist():
            yield schema.record_of(row)


def write_parquet(records: Iterator[dict[str, Any]], path: str, row_group_size: int = PARQUET_ROW_GROUP,
                  schema: RecordSchema = CAPTION_SCHEMA) -> int:
    """Stream `records` into a Parquet file at `path` (through `path.tmp` and an atomic rename),
    one row group per `row_group_size` records, the first record of each image only. Returns the
    number of rows."""
    tmp = path + ".tmp"
    try:
        arrow, records = schema.arrow_for(records)
        rows = _write_parquet_file(map(schema.row_of, records), tmp, arrow, row_group_size)
    except BaseException:  # a full disk, an interrupt: no half-written file is left beside the journal
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(path)
    return rows


def _write_parquet_file(rows_in: Iterator[dict[str, Any]], tmp: str, schema: Any, row_group_size: int) -> int:
    """`write_parquet`'s file at `tmp` from Arrow rows (`RecordSchema.row_of`; keyed as their records are),
    fsynced; returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seen: set[int] = set()
    rows = 0
    batch: list[dict[str, Any]] = []
    with pq.ParquetWriter(tmp, schema) as writer:
        def flush() -> None:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=row_group_size)
            batch.clear()

        for row in rows_in:
            h = key_hash(record_key(row))
            if h in seen:
                continue
            seen.add(h)
            batch.append(row)
            rows += 1
            if len(batch) >= row_group_size:
                flush()
        if batch or rows == 0:
            flush()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    return rows
