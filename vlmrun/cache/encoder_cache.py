"""Vision-encoder outputs kept by image content hash, evicted least-recently-used by token count."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ImageEmbedding:
    embeds: torch.Tensor  # [num_image_tokens, hidden]
    deepstack: Optional[torch.Tensor]  # [num_deepstack_layers, num_image_tokens, hidden] or None

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Optional[ImageEmbedding]:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: ImageEmbedding) -> None:
        if key in self.entries:
            return
        self.entries[key] = entry
        self.num_tokens += entry.num_tokens
        while self.num_tokens > self.capacity_tokens and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.num_tokens
