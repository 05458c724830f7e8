"""Vision-encoder outputs kept by image content hash, evicted least-recently-used by token count.

An entry can be pinned (`pin`): a request whose images are encoded drops their pixels and keeps
the embeddings here instead, pinned while its image item lives, because a preemption by recompute or
a later prefill chunk needs them again. Pins count toward the same capacity (the device memory the
cache may use does not change), are never evicted, and are refused once they would fill it; the
caller then keeps its pixels. A pin is counted per holder: the entry is unpinned (and evictable
again) when its last holder lets go (`unpin`). A holder that lets go from another thread (a finalizer
runs wherever the last reference goes) calls `unpin_later`, which only queues the key; the cache's
own thread applies it at its next call (`settle`), so the cache is only ever changed by one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class ImageEmbedding:
    embeds: torch.Tensor  # [num_image_tokens, hidden]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's, each [..., num_image_tokens, d]

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


@dataclass
class PinnedEmbedding:
    entry: ImageEmbedding
    holders: int


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[str, ImageEmbedding] = OrderedDict()  # evictable, least recently used first
        self.pinned: dict[str, PinnedEmbedding] = {}
        self.num_tokens = 0  # of the evictable entries
        self.num_pinned_tokens = 0
        self.hits = 0
        self.misses = 0
        self._unpinned: deque[str] = deque()  # keys let go from any thread (deque appends are atomic)

    def get(self, key: str) -> Optional[ImageEmbedding]:
        self.settle()
        pinned = self.pinned.get(key)
        entry = pinned.entry if pinned is not None else self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        if pinned is None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: ImageEmbedding) -> None:
        self.settle()
        if key in self.entries or key in self.pinned:
            return
        self.entries[key] = entry
        self.num_tokens += entry.num_tokens
        self._evict(keep=1)

    def pin(self, key: str, entry: ImageEmbedding) -> bool:
        """Hold `entry` under `key` until `unpin(key)`: True, or False when the pins would exceed the
        capacity (nothing changes then). Evictable entries make room."""
        self.settle()
        pinned = self.pinned.get(key)
        if pinned is not None:
            pinned.holders += 1
            return True
        if self.num_pinned_tokens + entry.num_tokens > self.capacity_tokens:
            return False
        if key in self.entries:
            entry = self.entries.pop(key)
            self.num_tokens -= entry.num_tokens
        self.pinned[key] = PinnedEmbedding(entry, 1)
        self.num_pinned_tokens += entry.num_tokens
        self._evict(keep=0)
        return True

    def unpin_later(self, key: str) -> None:
        """`unpin(key)` at the cache's next call, from any thread."""
        self._unpinned.append(key)

    def settle(self) -> None:
        """Apply the `unpin_later` calls made since the last call (on the cache's own thread)."""
        while self._unpinned:
            self.unpin(self._unpinned.popleft())

    def unpin(self, key: str) -> None:
        """A holder of `key`'s pin lets go; with the last one the entry is evictable again (most recent)."""
        pinned = self.pinned.get(key)
        if pinned is None:
            return
        pinned.holders -= 1
        if pinned.holders > 0:
            return
        del self.pinned[key]
        self.num_pinned_tokens -= pinned.entry.num_tokens
        self.put(key, pinned.entry)

    def _evict(self, keep: int) -> None:
        """Drop the least recently used evictable entries while over the capacity, keeping at least
        `keep` (an entry larger than the whole cache stays until the next one comes)."""
        while self.num_tokens + self.num_pinned_tokens > self.capacity_tokens and len(self.entries) > keep:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.num_tokens
