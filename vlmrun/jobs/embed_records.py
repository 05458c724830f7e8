"""The embedding job's record: the caption record's fields plus `embedding`, and its Parquet columns.

An `EmbeddingRecord` is a `CaptionRecord` (same key, resume, error and JSONL handling; `caption` is
null, `num_tokens` the prompt's tokens) with the vector in `embedding` (None for an error record). In
Parquet the vector is a fixed-size list column (`fixed_size_list<float32>[dim]`), its length read from
the first record that has one (`EMBEDDING_SCHEMA`); every vector of one output has that length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from vlmrun.jobs.records import RECORD_FIELDS, CaptionRecord, RecordSchema, arrow_schema, record_of, row_of

EMBEDDING_FIELDS = RECORD_FIELDS + ("embedding",)
FALLBACK_DIM = 1  # the column's length when no record has a vector (every input failed)


@dataclass
class EmbeddingRecord(CaptionRecord):
    embedding: Optional[list[float]] = None


def embedding_arrow_schema(dim: int):  # -> pyarrow.Schema
    import pyarrow as pa

    return arrow_schema().append(pa.field("embedding", pa.list_(pa.float32(), dim)))


def _arrow_for(records: Iterator[dict[str, Any]]) -> tuple[Any, Iterator[dict[str, Any]]]:
    """The schema whose vector length is the first vector's; the records read ahead are given back."""
    ahead: list[dict[str, Any]] = []
    dim = FALLBACK_DIM
    for record in records:
        ahead.append(record)
        if record.get("embedding") is not None:
            dim = len(record["embedding"])
            break
    return embedding_arrow_schema(dim), itertools.chain(ahead, records)


def _row_of(record: dict[str, Any]) -> dict[str, Any]:
    return {**row_of(record), "embedding": record.get("embedding")}


def _record_of(row: dict[str, Any]) -> dict[str, Any]:
    return {**record_of(row), "embedding": row.get("embedding")}


EMBEDDING_SCHEMA = RecordSchema(EMBEDDING_FIELDS, _arrow_for, _row_of, _record_of)
