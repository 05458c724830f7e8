"""Reading run-batch's input lines in bounded memory: a line longer than the cap is refused unread.

`bounded_lines(fh, cap)` yields each line's number and bytes, as `for line in fh` would, except that a
line of more than `cap` bytes (its newline not counted) is never held whole: once `cap` bytes of it are
read, the rest is skipped in pieces of `CHUNK` bytes and the line comes out as a `LongLine` (its size),
which the job answers with a 413 line. So a 300 MB line costs at most `cap` bytes of memory, not the
line plus the JSON parse of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Iterator, Union

CHUNK = 1 << 20  # bytes read at a time while skipping the rest of a long line
ENVELOPE_BYTES = 64 << 10  # a line's room beyond its request body: custom_id, method, url, the JSON around them


@dataclass
class LongLine:
    """A line longer than the cap: `size` its bytes (newline included), read and dropped."""

    size: int


def line_cap(max_request_bytes: int) -> int:
    """The longest line the job reads: the server's body limit plus the envelope of a batch line."""
    return max_request_bytes + ENVELOPE_BYTES


def bounded_lines(fh: IO[bytes], cap: int, chunk: int = CHUNK) -> Iterator[tuple[int, Union[bytes, LongLine]]]:
    """(line number from 1, the line's bytes or a LongLine) for every line of `fh` (module docstring)."""
    number = 0
    while True:
        piece = fh.readline(cap + 1)  # the line's first cap bytes and, when it fits, its newline
        if not piece:
            return
        number += 1
        if len(piece) <= cap or piece.endswith(b"\n"):
            yield number, piece
            continue
        size = len(piece)
        del piece
        while True:
            rest = fh.readline(chunk)
            size += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
        yield number, LongLine(size)
