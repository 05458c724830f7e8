"""The caption record: one per input image, the same fields in JSONL and Parquet.

A record is keyed by `image`, the input as the job names it (a path as expanded, a manifest entry
as written, or a URL). Resume and de-duplication compare 64-bit hashes of that key, so a job over
millions of inputs keeps a compact set of integers, never the path strings themselves.

A file name that is not valid UTF-8 reaches Python as a string with lone surrogates, which JSON
and Parquet cannot hold as text. Such a record's `image` is the name's readable form (U+FFFD for
each undecodable byte) and `image_escaped` holds the name's bytes percent-encoded (RFC 3986), so
nothing is lost: `record_key` recovers the key, and `urllib.parse.unquote_to_bytes` the bytes.
`image_escaped` is null for every other record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

# Field order of the record (JSONL keys and Parquet columns).
RECORD_FIELDS: tuple[str, ...] = (
    "image", "caption", "num_tokens", "model", "prompt", "error", "finish_reason", "preprocess_s", "generate_s",
    "image_escaped", "parsed", "kind", "columns",
)
JSON_TEXT_FIELDS = ("parsed", "columns")  # any JSON value: Parquet and Ray store it as JSON text


@dataclass
class CaptionRecord:
    """The outcome for one image.

    caption: the generated text, None when the image failed.
    parsed: with a structured-output job (--json-schema / --regex / --choice), the caption parsed:
        the JSON value, or the matched string; None otherwise, and an output that does not complete
        its constraint (cut by --max-tokens, a stop string) is an error record that says so. Parquet
        (which has no "any JSON" type) stores it as JSON text; it reads back as the value.
    num_tokens: generated tokens (0 for a failure).
    error: None on success, else a message naming the problem (the image is not retried on resume
        unless the job runs with --retry-errors).
    finish_reason: "stop" (EOS or a stop string), "length" (max tokens), "error".
    preprocess_s: seconds spent reading, decoding and preprocessing the image (worker thread).
    generate_s: seconds from the request entering the engine to its last token.
    image_escaped: set (from `image`) when the key is not valid Unicode, see the module docstring.
    kind: "image" or "video" (a file with a video suffix: one record per video; the key stays `image`).
    columns: a manifest row's other columns (e.g. {"id": 7, "label": "cat"}), None for other inputs.
    """

    image: str
    caption: Optional[str]
    num_tokens: int
    model: str
    prompt: str
    error: Optional[str]
    finish_reason: Optional[str]
    preprocess_s: float
    generate_s: float
    image_escaped: Optional[str] = None
    parsed: Any = None
    kind: str = "image"
    columns: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.image_escaped is None and not _is_unicode(self.image):
            raw = _key_bytes(self.image)
            self.image_escaped = urllib.parse.quote(raw, safe="/")
            self.image = raw.decode("utf-8", "replace")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failure(cls, image: str, model: str, prompt: str, error: str, preprocess_s: float = 0.0) -> "CaptionRecord":
        return cls(image=image, caption=None, num_tokens=0, model=model, prompt=prompt, error=error,
                   finish_reason="error", preprocess_s=round(preprocess_s, 6), generate_s=0.0)


def parse_structured(spec: Any, text: str, grammar_ended: bool, finish_reason: Optional[str]) -> tuple[Any, Optional[str]]:
    """(parsed value, None), or (None, the error) when `text` did not complete `spec`
    (a `StructuredOutputsParams`; `grammar_ended`: the request's grammar terminated)."""
    if not grammar_ended:
        why = "cut by --max-tokens" if finish_reason == "length" else f"finish_reason {finish_reason!r}"
        return None, f"the output does not complete its {spec.kind} constraint ({why}): ...{text[-60:]!r}"
    if spec.kind not in ("json", "json_object"):
        return text, None
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"the output is not valid JSON ({exc})"


def record_key(record: dict[str, Any]) -> str:
    """The key a written record (a JSONL line, a Parquet row) was made for."""
    escaped = record.get("image_escaped")
    if isinstance(escaped, str):
        return urllib.parse.unquote_to_bytes(escaped).decode("utf-8", "surrogateescape")
    return record["image"]


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _key_bytes(key: str) -> bytes:
    """The bytes of a key holding lone surrogates: a file name's own bytes (as os.fsencode gives
    them on a UTF-8 system); other lone surrogates in their UTF-8 form."""
    try:
        return key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a record key (collision odds ~1e-8 at a million keys)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def image_seed(base_seed: int, key: str) -> int:
    """The sampling seed of one image: depends on the job seed and the image only, so a resumed
    or re-ordered job draws the same caption for the same image."""
    return (base_seed * 0x9E3779B1 + key_hash(key)) % (2**31 - 1)


def arrow_schema():  # -> pyarrow.Schema (pyarrow is imported only when Parquet is used)
    import pyarrow as pa

    return pa.schema([
        ("image", pa.string()), ("caption", pa.string()), ("num_tokens", pa.int32()), ("model", pa.string()),
        ("prompt", pa.string()), ("error", pa.string()), ("finish_reason", pa.string()),
        ("preprocess_s", pa.float64()), ("generate_s", pa.float64()), ("image_escaped", pa.string()),
        ("parsed", pa.string()), ("kind", pa.string()), ("columns", pa.string()),
    ])


def row_of(record: dict[str, Any]) -> dict[str, Any]:
    """A record as an Arrow row (Parquet, Ray): its fields in order, any-JSON fields as JSON text."""
    row = {f: record.get(f) for f in RECORD_FIELDS}
    for name in JSON_TEXT_FIELDS:
        if row[name] is not None:
            row[name] = json.dumps(row[name], ensure_ascii=False, default=str)
    return row


def record_of(row: dict[str, Any]) -> dict[str, Any]:
    """An Arrow row back as a record dict (`row_of`'s inverse; fields a row lacks are None)."""
    record = {f: row.get(f) for f in RECORD_FIELDS}
    for name in JSON_TEXT_FIELDS:
        if record[name] is not None:
            record[name] = json.loads(record[name])
    return record


@dataclass(frozen=True)
class RecordSchema:
    """How a job's records are stored as Arrow rows (Parquet): the caption record's (`CAPTION_SCHEMA`), or
    a job's own (the embedding job's adds a fixed-size vector column: `vlmrun/jobs/embed_records.py`).
    `arrow_for(records)`: the Arrow schema for these records and the records again (a schema that
    depends on them, e.g. a vector's length, may read ahead)."""

    fields: tuple[str, ...]
    arrow_for: Callable[[Iterator[dict[str, Any]]], tuple[Any, Iterator[dict[str, Any]]]]
    row_of: Callable[[dict[str, Any]], dict[str, Any]]
    record_of: Callable[[dict[str, Any]], dict[str, Any]]


CAPTION_SCHEMA = RecordSchema(RECORD_FIELDS, lambda records: (arrow_schema(), records), row_of, record_of)
