"""Per-request speculative decoding counters, with vLLM's names.

A request that speculated carries `SpecDecodeStats` in its result (`RequestResult.spec_decode`) and
in `RequestOutput.metrics.spec_decode`: verify steps that fed drafts (`num_drafts`), draft tokens
fed (`num_draft_tokens`) and accepted (`num_accepted_tokens`, counted before a stop cut the run).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verify step of a request: drafts fed, and how many the sampled tokens accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gave on average: 1 (the bonus or corrected token) + its accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def merged(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counters of two choices of one request as one."""
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens)
