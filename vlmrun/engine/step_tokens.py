"""`StepTokenHistogram`: how many tokens each engine step produced for its requests, as a cumulative
histogram (vLLM's `iteration_tokens_total`: per step, the prompt tokens of the requests whose prefill
ended in it plus the tokens it generated). The async engine's thread observes each step; the server
reads a copy from the stats snapshot at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for iteration_tokens_total
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepTokenHistogram:
    """Counts of steps per bucket (`counts[i]`: steps with at most `buckets[i]` tokens and more than the
    bucket before; the last entry: above every bucket), their token sum and number."""

    buckets: tuple[int, ...] = STEP_TOKEN_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    sum: int = 0
    count: int = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, tokens)] += 1
        self.sum += tokens
        self.count += 1

    def copy(self) -> "StepTokenHistogram":
        return StepTokenHistogram(self.buckets, list(self.counts), self.sum, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound as Prometheus writes it, steps at or below it), "+Inf" last."""
        out, total = [], 0
        for bound, n in zip([*map(float, self.buckets), float("inf")], self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out
