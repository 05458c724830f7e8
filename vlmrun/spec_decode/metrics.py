"""Speculative decoding counters, with vLLM's names.

A request that speculated carries `SpecDecodeStats` in its result (`RequestResult.spec_decode`) and
in `RequestOutput.metrics.spec_decode`: verify steps that fed drafts (`num_drafts`), draft tokens
fed (`num_draft_tokens`) and accepted (`num_accepted_tokens`, counted before a stop cut the run),
and, per draft position, how many drafts at that position were accepted
(`num_accepted_tokens_per_pos[j]`: draft j + 1 of a verify step). The scheduler keeps the same
counters summed over every request (`Engine.stats().spec_decode`), which the server's `/metrics` and
the caption job's summary show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [j]: accepted drafts at position j

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verify step of a request: drafts fed, and how many the sampled tokens accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted_tokens):  # the accepted drafts are the first ones
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gave on average: 1 (the bonus or corrected token) + its accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def merged(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counters of two choices of one request (or two engines) as one."""
        per_pos = [a + b for a, b in zip_longest(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos,
                                                 fillvalue=0)]
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens, per_pos)

    def copy(self) -> "SpecDecodeStats":
        return self.merged(SpecDecodeStats())
