"""The caption record: one per input image, the same fields in JSONL and Parquet.

A record is keyed by `image`, the input as the job names it (a path as expanded, a manifest entry
as written, or a URL). Resume and de-duplication compare 64-bit hashes of that key, so a job over
millions of inputs keeps a compact set of integers, never the path strings themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Optional

# Field order of the record (JSONL keys and Parquet columns).
RECORD_FIELDS: tuple[str, ...] = (
    "image", "caption", "num_tokens", "model", "prompt", "error", "finish_reason", "preprocess_s", "generate_s",
)


@dataclass
class CaptionRecord:
    """The outcome for one image.

    caption: the generated text, None when the image failed.
    num_tokens: generated tokens (0 for a failure).
    error: None on success, else a message naming the problem (the image is not retried on resume
        unless the job runs with --retry-errors).
    finish_reason: "stop" (EOS or a stop string), "length" (max tokens), "error".
    preprocess_s: seconds spent reading, decoding and preprocessing the image (worker thread).
    generate_s: seconds from the request entering the engine to its last token.
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failure(cls, image: str, model: str, prompt: str, error: str, preprocess_s: float = 0.0) -> "CaptionRecord":
        return cls(image=image, caption=None, num_tokens=0, model=model, prompt=prompt, error=error,
                   finish_reason="error", preprocess_s=round(preprocess_s, 6), generate_s=0.0)


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
        ("preprocess_s", pa.float64()), ("generate_s", pa.float64()),
    ])
