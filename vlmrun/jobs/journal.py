"""The journal: an append-only JSONL file of caption records, crash-safe and resumable.

Crash safety rests on this one file format: one JSON record per line, each line written by a
single `os.write` on a file opened with O_APPEND, so a killed process leaves whole lines (the
kernel has them as soon as `write` returns) and at worst, after a power loss or a full disk, a
torn last line. The file is fsynced at most every `fsync_interval` seconds and at close (a power
loss can cost the last second of records, which a resume then redoes).

Scanning a journal **repairs** it, and only it: a torn last line of a record (it starts as every
record line does) is cut off (the file is rewritten through a temporary file and an atomic rename).
A file with any other line, complete lines that are not records (another program's JSONL,
a manifest) or a torn line that is not one, is not a journal: `NotAJournalError`, and the file is
left as it was. What remains is the set of recorded keys (`ResumeState`), which a rerun skips.
What a record line is and which key it records is a `RecordFormat`: caption records
(`CAPTION_RECORDS`, the default) or `vlmrun run-batch`'s output lines (`run_batch_lines.py`).
The outputs built on it are in `sink.py`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from vlmrun.jobs.records import RECORD_FIELDS, key_hash, record_key


@dataclass
class ResumeState:
    """What an existing output already holds."""

    done: set[int] = field(default_factory=set)  # key hashes of recorded images (batch lines)
    ok: int = 0
    failed: int = 0
    dropped_lines: int = 0  # the torn last record line removed by the repair (0 or 1)
    retried: int = 0  # error records removed for --retry-errors
    models: set[str] = field(default_factory=set)
    prompts: set[str] = field(default_factory=set)


def encode_record(record: dict[str, Any]) -> bytes:
    """One journal line. Text is kept as UTF-8; strings a UTF-8 encoder refuses (lone surrogates
    from undecodable file names) fall back to JSON escapes, so every line is valid JSON."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":")).encode("ascii") + b"\n"


class NotAJournalError(ValueError):
    """The file holds lines no caption job wrote: it is not touched."""


# the fields every record has (later fields, e.g. `parsed`, came with later versions)
_RECORD_CORE = RECORD_FIELDS[:RECORD_FIELDS.index("finish_reason") + 1]


def _is_caption_record(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("image"), str) and all(k in value for k in _RECORD_CORE)


@dataclass(frozen=True)
class RecordFormat:
    """What the record lines of one kind of journal are.

    start: the bytes every record line begins with (the writer puts its fields in a fixed order), so
        that a torn last line can be told from a foreign one; is_record: whether a parsed JSON value is
        a record; key: the key a record was written for; what: the job's name, for messages."""

    start: bytes
    is_record: Callable[[Any], bool]
    key: Callable[[dict[str, Any]], str]
    what: str


CAPTION_RECORDS = RecordFormat(start=b'{"image":', is_record=_is_caption_record, key=record_key, what="caption")


def _parse_line(line: bytes, fmt: RecordFormat) -> Optional[dict[str, Any]]:
    """The record on a whole line, or None when the line is anything else."""
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if fmt.is_record(value) else None


def iter_journal(path: str, fmt: RecordFormat = CAPTION_RECORDS) -> Iterator[dict[str, Any]]:
    """The whole-line records of a journal (a torn last line and invalid lines are skipped)."""
    with open(path, "rb") as fh:
        for line in fh:
            if line.endswith(b"\n"):
                record = _parse_line(line, fmt)
                if record is not None:
                    yield record


def fsync_dir(path: str) -> None:
    """Make the creation, rename or removal of `path` durable: fsync its folder (best effort)."""
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


def rewrite_journal(path: str, records: Iterator[dict[str, Any]]) -> None:
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
    fsync_dir(path)


def scan_records(records: Iterator[dict[str, Any]], retry_errors: bool,
                  state: Optional[ResumeState] = None, fmt: RecordFormat = CAPTION_RECORDS) -> ResumeState:
    """Count `records` into `state` (error records left out with retry_errors)."""
    state = state if state is not None else ResumeState()
    for record in records:
        failed = record.get("error") is not None
        if failed and retry_errors:
            state.retried += 1
            continue
        h = key_hash(fmt.key(record))
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


def scan_journal(path: str, retry_errors: bool = False, fmt: RecordFormat = CAPTION_RECORDS) -> ResumeState:
    """Repair the journal at `path` (if it exists) and return what it records.

    retry_errors: drop the error records, so that their images are captioned (their lines run) again."""
    state = ResumeState()
    if not os.path.exists(path):
        return state
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.endswith(b"\n") and line.startswith(fmt.start):
                state.dropped_lines += 1  # the torn last line of a record: a crash mid-write
            elif _parse_line(line, fmt) is None:
                raise NotAJournalError(f"{path!r} is not a {fmt.what} job's output: line {number} is not a "
                                       f"{fmt.what} record; it is left untouched (name another output, or move "
                                       "the file)")
    scan_records(iter_journal(path, fmt), retry_errors, state, fmt)
    if state.dropped_lines or state.retried:
        kept = (r for r in iter_journal(path, fmt) if not (retry_errors and r.get("error") is not None))
        rewrite_journal(path, kept)
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
            fsync_dir(path)
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
