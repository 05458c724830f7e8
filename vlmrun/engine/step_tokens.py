"""`BucketHistogram`: a cumulative histogram kept as plain counts (Prometheus' `le` buckets), filled one value
at a time or a numpy array at once, copied into the engine's stats snapshot and written out at scrape time;
and `StepTokenHistogram`, the one of how many tokens each engine step produced for its requests (vLLM's
`iteration_tokens_total`: per step, the prompt tokens of the requests whose prefill ended in it plus the
tokens it generated). `engine/token_timing.py` fills both on the engine thread; the server reads copies
from the stats snapshot.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Union

import numpy as np

# vLLM's buckets for iteration_tokens_total
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

Number = Union[int, float]


@dataclass
class BucketHistogram:
    """Counts of values per bucket (`counts[i]`: values at most `buckets[i]` and above the bucket before;
    the last entry: above every bucket), their sum and number."""

    buckets: tuple[Number, ...]
    counts: list[int] = field(default_factory=list)
    sum: Number = 0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: Number) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def observe_array(self, values: np.ndarray) -> None:
        """Every value of `values` [n] (one searchsorted and one bincount, no Python per value)."""
        if not values.size:
            return
        at = np.searchsorted(self.buckets, values, side="left")  # [n] the first bucket >= value (`le`)
        added = np.bincount(at, minlength=len(self.counts))  # [len(buckets) + 1]
        self.counts = [a + b for a, b in zip(self.counts, added.tolist())]
        self.sum += float(values.sum())
        self.count += int(values.size)

    def copy(self) -> "BucketHistogram":
        return type(self)(self.buckets, list(self.counts), self.sum, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound as Prometheus writes it, values at or below it), "+Inf" last."""
        out, total = [], 0
        for bound, n in zip([*map(float, self.buckets), float("inf")], self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


@dataclass
class StepTokenHistogram(BucketHistogram):
    """Tokens per engine step, in vLLM's `iteration_tokens_total` buckets."""

    buckets: tuple[Number, ...] = STEP_TOKEN_BUCKETS
