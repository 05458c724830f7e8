"""Expanding a caption job's INPUT arguments into a lazy stream of images (and videos).

Files with a video suffix (`VIDEO_SUFFIXES`) are taken wherever image files are: one record per
video (`is_video`).

An INPUT is one of:
- an http(s):// or file:// URL (or a data: URI): one image;
- a directory: every file with an image suffix below it, recursively (hidden files and folders
  skipped, sorted by name within each folder, files before subfolders; other files are counted in
  `InputStats.ignored_files`, never captioned);
- a manifest, a file ending in .txt / .csv / .jsonl / .parquet: one image per line / row. Entries
  are paths or URLs; a relative path is read relative to the manifest's folder but keyed as
  written. The column is `--image-column`, else the first of image, path, url, file, filename,
  uri present, else the first column;
- a glob pattern (`*`, `?`, `[`; `**` recurses): matching image files, and directories walked;
- anything else: an image path taken as given (a missing file becomes an error record).

Nothing is listed ahead: directories are walked and manifests read as the job consumes them, so
a million-line manifest costs no more memory than a ten-line one. Inputs that cannot be read
(an unreadable folder or manifest, a malformed manifest line, a glob matching nothing) come out
as items carrying an error, which the job records like any failed image.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

from vlmrun.jobs.records import key_hash

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff",
                            ".avif"})
VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts"})
MEDIA_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES
MANIFEST_SUFFIXES = frozenset({".txt", ".csv", ".jsonl", ".parquet"})
KEY_COLUMNS = ("image", "path", "url", "file", "filename", "uri")
_URL_PREFIXES = ("http://", "https://", "file://", "data:")
_PARQUET_BATCH_ROWS = 8192


@dataclass
class JobItem:
    """One image of a job. key: how the record names it; source: what is loaded (path, URL,
    bytes, array); error: set when the input is already known to be bad."""

    key: str
    source: Any
    error: Optional[str] = None
    columns: Optional[dict[str, Any]] = None  # a manifest row's other columns: carried into its record


@dataclass
class InputStats:
    """Counts kept while inputs are expanded (read by the summary)."""

    ignored_files: int = 0  # files under a directory or glob without an image suffix
    skipped_done: int = 0  # already recorded in the output (resume)
    duplicates: int = 0  # the same key listed twice: captioned once


def is_url(text: str) -> bool:
    return text[:8].lower().startswith(_URL_PREFIXES)


def iter_items(specs: Sequence[str], image_column: Optional[str] = None,
               stats: Optional[InputStats] = None) -> Iterator[JobItem]:
    """Every image named by `specs`, lazily, in order."""
    stats = stats if stats is not None else InputStats()
    for spec in specs:
        if is_url(spec):
            yield JobItem(spec, spec)
        elif os.path.isdir(spec):
            yield from _walk(spec, stats)
        elif os.path.isfile(spec) and _suffix(spec) in MANIFEST_SUFFIXES:
            yield from iter_manifest(spec, image_column)
        elif glob.has_magic(spec) and not os.path.exists(spec):
            yield from _glob(spec, stats)
        else:
            yield JobItem(spec, spec)


def new_items(items: Iterable[JobItem], done: frozenset[int] | set[int], stats: InputStats) -> Iterator[JobItem]:
    """`items` less those already recorded (`done`: key hashes) and less repeated keys.

    Keeps one 64-bit hash per new key, so memory grows by ~70 bytes per image, never by the
    images themselves."""
    seen: set[int] = set()
    for item in items:
        h = key_hash(item.key)
        if h in done:
            stats.skipped_done += 1
        elif h in seen:
            stats.duplicates += 1
        else:
            seen.add(h)
            yield item


def count_new(specs: Sequence[str], done: frozenset[int] | set[int], image_column: Optional[str] = None) -> int:
    """How many inputs are not yet recorded (repeated keys count once each time; for the
    progress bar's total)."""
    return sum(1 for item in iter_items(specs, image_column, InputStats()) if key_hash(item.key) not in done)


# --------------------------------------------------------------------------------------------
# directories and globs


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def is_video(source: Any) -> bool:
    """A path or URL (query and fragment ignored) whose suffix is a video suffix."""
    if not isinstance(source, str) or source[:5].lower() == "data:":
        return isinstance(source, str) and source[5:11].lower() == "video/"
    return _suffix(source.split("?", 1)[0].split("#", 1)[0]) in VIDEO_SUFFIXES


def _walk(root: str, stats: InputStats) -> Iterator[JobItem]:
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            yield JobItem(folder, folder, error=f"cannot list directory {folder!r}: {exc.strerror or exc}")
            continue
        subfolders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                subfolders.append(entry.path)
            elif _suffix(entry.name) in MEDIA_SUFFIXES:
                yield JobItem(entry.path, entry.path)
            else:
                stats.ignored_files += 1
        stack.extend(reversed(subfolders))


def _glob(pattern: str, stats: InputStats) -> Iterator[JobItem]:
    matched = False
    for path in glob.iglob(pattern, recursive=True):
        matched = True
        if os.path.isdir(path):
            yield from _walk(path, stats)
        elif _suffix(path) in MEDIA_SUFFIXES:
            yield JobItem(path, path)
        else:
            stats.ignored_files += 1
    if not matched:
        yield JobItem(pattern, pattern, error=f"no file matches the pattern {pattern!r}")


# --------------------------------------------------------------------------------------------
# manifests


@dataclass
class _Manifest:
    path: str
    folder: str = field(init=False)

    def __post_init__(self) -> None:
        self.folder = os.path.dirname(self.path)

    def item(self, entry: Any, where: str) -> Optional[JobItem]:
        """The item of one manifest entry (None for an empty one)."""
        if entry is None:
            return None
        if not isinstance(entry, str):
            return JobItem(f"{self.path}:{where}", None, error=f"{self.path} {where}: expected a path or URL string, "
                                                                f"got {type(entry).__name__}")
        entry = entry.strip()
        if not entry:
            return None
        if is_url(entry) or os.path.isabs(entry):
            return JobItem(entry, entry)
        return JobItem(entry, os.path.join(self.folder, entry))


def iter_manifest(path: str, image_column: Optional[str] = None) -> Iterator[JobItem]:
    """The images listed in one manifest file, read as it is consumed."""
    manifest = _Manifest(path)
    suffix = _suffix(path)
    try:
        if suffix == ".parquet":
            yield from _parquet_items(manifest, image_column)
            return
        with open(path, encoding="utf-8", newline="" if suffix == ".csv" else None) as fh:
            if suffix == ".txt":
                yield from _text_items(manifest, fh)
            elif suffix == ".csv":
                yield from _csv_items(manifest, fh, image_column)
            else:
                yield from _jsonl_items(manifest, fh, image_column)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        yield JobItem(path, None, error=f"cannot read manifest {path!r}: {exc}")


def _text_items(manifest: _Manifest, lines: Iterable[str]) -> Iterator[JobItem]:
    for lineno, line in enumerate(lines, 1):
        if line.lstrip().startswith("#"):
            continue
        item = manifest.item(line, f"line {lineno}")
        if item is not None:
            yield item


def _pick_column(names: Sequence[str], wanted: Optional[str]) -> int:
    lowered = [str(n).strip().lower() for n in names]
    if wanted is not None:
        if wanted.lower() not in lowered:
            raise ValueError(f"no column {wanted!r} (columns: {', '.join(map(str, names))})")
        return lowered.index(wanted.lower())
    for name in KEY_COLUMNS:
        if name in lowered:
            return lowered.index(name)
    return 0


def _csv_items(manifest: _Manifest, fh: Iterable[str], image_column: Optional[str]) -> Iterator[JobItem]:
    reader = csv.reader(fh)
    header = next(reader, None)
    if header is None:
        return
    looks_like_data = bool(header) and (is_url(header[0]) or _suffix(header[0].strip()) in MEDIA_SUFFIXES)
    if looks_like_data and image_column is None:  # no header row: the first column holds the images
        column = 0
        item = manifest.item(header[0], "row 1")
        if item is not None:
            yield item
    else:
        column = _pick_column(header, image_column)
    names = None if looks_like_data and image_column is None else header
    for rowno, row in enumerate(reader, 2):
        if not row:
            continue
        value = row[column] if column < len(row) else None
        item = manifest.item(value, f"row {rowno}")
        if item is not None:
            if names is not None:
                item.columns = {str(n): v for i, (n, v) in enumerate(zip(names, row)) if i != column} or None
            yield item


def _jsonl_items(manifest: _Manifest, fh: Iterable[str], image_column: Optional[str]) -> Iterator[JobItem]:
    for lineno, line in enumerate(fh, 1):
        if not line.strip():
            continue
        where = f"line {lineno}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield JobItem(f"{manifest.path}:{where}", None, error=f"{manifest.path} {where}: not JSON ({exc.msg})")
            continue
        columns = None
        if isinstance(value, dict):
            keys = [image_column] if image_column else [k for k in KEY_COLUMNS if k in value]
            if not keys or keys[0] not in value:
                yield JobItem(f"{manifest.path}:{where}", None,
                              error=f"{manifest.path} {where}: no {image_column or '/'.join(KEY_COLUMNS)} field")
                continue
            columns = {k: v for k, v in value.items() if k != keys[0]} or None
            value = value[keys[0]]
        item = manifest.item(value, where)
        if item is not None:
            item.columns = columns
            yield item


def _parquet_items(manifest: _Manifest, image_column: Optional[str]) -> Iterator[JobItem]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(manifest.path)
    names = pf.schema_arrow.names
    column = names[_pick_column(names, image_column)]
    offset = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for i, row in enumerate(batch.to_pylist()):
            item = manifest.item(row[column], f"row {offset + i + 1}")
            if item is not None:
                item.columns = {k: v for k, v in row.items() if k != column} or None
                yield item
        offset += batch.num_rows
