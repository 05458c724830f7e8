"""Results back in input order through a bounded window: a result waits only for earlier ones still open.

    window = ReorderWindow(size)
    slot = window.open()              # in input order; refused (ValueError) while `full`
    ...
    window.close(slot, value)         # in any order
    for value in window.released():   # the values whose earlier slots are all closed, in order
        write(value)

At most `size` slots are open or closed-but-waiting, so a long run holds `size` values, not all of
them: when the earliest is slow the window fills and its owner stops taking inputs until it closes.
run-batch writes its output lines through one (vLLM writes them in input order).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")
_OPEN = object()


class ReorderWindow(Generic[T]):
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"the reorder window needs size >= 1, got {size}")
        self.size = size
        self._first = 0  # the slot number of _slots[0]
        self._slots: deque = deque()  # values, or _OPEN, from slot _first on

    def __len__(self) -> int:
        """Slots open or waiting for an earlier one."""
        return len(self._slots)

    @property
    def full(self) -> bool:
        return len(self._slots) >= self.size

    def open(self) -> int:
        """A new slot, after every slot opened before it."""
        if self.full:
            raise ValueError(f"the reorder window is full ({self.size} slots)")
        self._slots.append(_OPEN)
        return self._first + len(self._slots) - 1

    def close(self, slot: int, value: T) -> None:
        position = slot - self._first
        if not 0 <= position < len(self._slots) or self._slots[position] is not _OPEN:
            raise ValueError(f"slot {slot} is not open")
        self._slots[position] = value

    def released(self) -> Iterator[T]:
        """The values at the front whose slots are closed, in slot order (each handed out once)."""
        while self._slots and self._slots[0] is not _OPEN:
            self._first += 1
            yield self._slots.popleft()
