"""Verifying drafts in the model runner: one sampling row per position, acceptance, seeded draws.

A speculating chunk feeds the request's last known token and d drafts, and the model gives logits at
all 1 + d positions. Position j's logits are what plain decode would see once drafts[:j] had been
accepted, so the sampler gets one row per position (`position_rows`): the request's sampling row with
drafts[:j] appended to its outputs, so that penalties, bad words and min_tokens see them as plain
decode would, with the same temperature, truncation and generator, and a request with a grammar gets
the mask of the grammar state after drafts[:j] (`grammar.py`). The sampler samples each
position exactly as plain decode samples a token; draft j is accepted when it equals the token
sampled at position j and every draft before it was accepted (`count_accepted`). The step gives the
tokens sampled at positions 0..a: the a accepted drafts, then the bonus token (all accepted) or the
token that replaced the first rejected draft.

This is the standard rejection sampler for a point-mass draft (an n-gram draft is one token t, with
probability 1): that accepts t with probability p(t) and on rejection draws from (p - onehot(t))+,
normalised. Drawing x ~ p and accepting iff x == t does both with one draw: P(accept) = p(t), and x
given x != t has exactly the residual distribution. Greedy rows (argmax) accept the longest prefix of
drafts that matches the model's greedy tokens.

Seeded rows: the sampler draws one noise row per position from the request's own generator, in
position order: the draws plain decode makes for those tokens. After a rejection, the draws of the
positions behind it belong to tokens that were never emitted; `SeededDraws.keep` winds the generator
back to just after the emitted positions, so a seeded request gives the tokens it gives without
speculation.

`Verification` is the runner's one object for all of it in a step: the rows, the seeded draws, the
acceptance on the device (queued with the step, computed once and kept for the step's sampled ids: the
penalty counts and the runner's settling read the same tensor) and on the host (at collect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from vlmrun.host_to_device import upload
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.spec_decode.grammar import Masks


def position_rows(row: SamplingRow, drafts: Sequence[int], masks: Optional[Masks] = None) -> list[SamplingRow]:
    """The sampling row of each of the 1 + len(drafts) verified positions: position j sees the
    outputs followed by drafts[:j] and, for a request with a grammar, `masks[j - 1]` (the grammar
    after drafts[:j], `vlmrun/spec_decode/grammar.py`; None: no mask)."""
    if not drafts:
        return [row]
    outputs = list(row.output_token_ids)
    rows = [row._replace(output_token_ids=outputs + list(drafts[:j])) for j in range(1, len(drafts) + 1)]
    if masks is not None:
        rows = [r._replace(grammar=mask) for r, mask in zip(rows, masks, strict=True)]
    return [row] + rows


def accepted_on_device(sampled: torch.Tensor, first_rows: Sequence[int], drafts: torch.Tensor,
                       num_drafts: Sequence[int]) -> torch.Tensor:
    """`count_accepted` of the speculating chunks on the device, without a sync: sampled [rows] the step's
    sampled ids, first_rows[i] chunk i's first row in them, drafts [chunks, width] on the device (row i's
    first num_drafts[i] are its drafts) -> [chunks] int64. The step's device writes that depend on
    acceptance (GDN slots, MTP outputs, each row's last token) are queued with the step that way, in
    step order, whenever the host reads the tokens (async scheduling)."""
    width = drafts.shape[1]
    at = (torch.tensor(first_rows, dtype=torch.int64)[:, None] + torch.arange(width)[None, :]).clamp_(
        max=sampled.shape[0] - 1)  # [chunks, width] (past a chunk's drafts: masked out below)
    valid = torch.arange(width)[None, :] < torch.tensor(num_drafts, dtype=torch.int64)[:, None]
    matches = (sampled[upload(at, sampled.device)] == drafts) & upload(valid, sampled.device)
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)


def count_accepted(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts, from the first, equal the token sampled at their position. sampled: 1 + len(drafts) ids."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class SeededDraws:
    """A seeded sampled request's generator as it was before its verify positions drew their noise."""

    def __init__(self, generator: torch.Generator, vocab_size: int, device: torch.device):
        self.generator = generator
        self.state = generator.get_state()
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def before_sampling(cls, row: SamplingRow, num_drafts: int, vocab_size: int,
                        device: torch.device) -> Optional["SeededDraws"]:
        """For a speculating row that draws from its own generator; None for the others."""
        if not num_drafts or row.generator is None or row.params.is_greedy:
            return None
        return cls(row.generator, vocab_size, device)

    def keep(self, num_positions: int) -> None:
        """Leave the generator as if only the first `num_positions` positions had drawn: back to the
        state before sampling, then the same draws again (one float32 noise row of the vocabulary each,
        as `Sampler._draw` makes them)."""
        self.generator.set_state(self.state)
        scratch = torch.empty(self.vocab_size, dtype=torch.float32, device=self.device)
        for _ in range(num_positions):
            scratch.exponential_(generator=self.generator)


@dataclass
class Verification:
    """One step's draft verification, per chunk of the step in order: `rows[i]` its sampling row (None: it
    does not sample), `drafts[i]` its drafts (empty: it does not speculate; MTP's are read from the device
    at collect, `drafts_on_host`). The runner asks it for the sampling row of every verified position, the
    seeded rows' generators before their draws, how many drafts each chunk keeps on the device (queued with
    the step) and, at collect, the tokens each chunk emits."""

    rows: list[Optional[SamplingRow]]
    drafts: list[list[int]]
    seeded: list[Optional[SeededDraws]] = field(default_factory=list)
    # the step's acceptance on the device, once computed: (sampled, first_rows, drafted) it came from, and it
    _accepted: Optional[tuple[torch.Tensor, tuple[int, ...], Optional[torch.Tensor], torch.Tensor]] = field(
        default=None, repr=False, compare=False)

    @classmethod
    def of(cls, rows: list[Optional[SamplingRow]], drafts: list[list[int]]) -> Optional["Verification"]:
        """None when no chunk speculates (the step samples one row a sampling chunk)."""
        return cls(rows, drafts) if any(drafts) else None

    def position_rows(self, masks: Sequence[Optional[Masks]]) -> list[SamplingRow]:
        """The sampling row of every verified position, chunk after chunk (`masks`: per chunk, its grammar
        masks after the drafts, or None)."""
        return [row for r, d, m in zip(self.rows, self.drafts, masks) if r is not None
                for row in position_rows(r, d, m)]

    def before_sampling(self, vocab_size: int, device: torch.device) -> None:
        """Keep each seeded speculating row's generator state before the positions draw from it."""
        self.seeded = [None if r is None else SeededDraws.before_sampling(r, len(d), vocab_size, device)
                       for r, d in zip(self.rows, self.drafts)]

    def accepted_on_device(self, sampled: torch.Tensor, first_rows: Sequence[int],
                           drafted: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
        """[chunks] int64 on the device: the drafts each chunk keeps (0 for a chunk without), from the step's
        sampled ids and each chunk's first row in them; `drafted` [speculating chunks, width] the drafts on
        the device when they were made there (MTP), else the host's go up. Computed once a step: what reads
        it in the step (the penalty counts' emitted tokens, the runner's GDN slots, MTP outputs and
        `last_tokens`) asks for the same `sampled` tensor and gets the same result tensor."""
        key = tuple(first_rows)
        if self._accepted is not None:
            was_sampled, was_first_rows, was_drafted, accepted = self._accepted
            if was_sampled is sampled and was_first_rows == key and drafted is was_drafted:
                return accepted
        accepted = self._accept(sampled, first_rows, drafted, device)
        self._accepted = (sampled, key, drafted, accepted)
        return accepted

    def _accept(self, sampled: torch.Tensor, first_rows: Sequence[int], drafted: Optional[torch.Tensor],
                device: torch.device) -> torch.Tensor:
        """`accepted_on_device`, computed: [chunks] int64 on the device."""
        speculating = [i for i, d in enumerate(self.drafts) if d]
        counts = [len(self.drafts[i]) for i in speculating]
        if drafted is None:
            width = max(counts)
            drafted = upload(torch.tensor([self.drafts[i] + [0] * (width - len(self.drafts[i])) for i in speculating],
                                          dtype=torch.int64), device)
        accepted = torch.zeros(len(self.drafts), dtype=torch.int64, device=device)  # [chunks]
        accepted[upload(torch.tensor(speculating, dtype=torch.int64), device)] = accepted_on_device(
            sampled, [first_rows[i] for i in speculating], drafted, counts)
        return accepted

    def emitted(self, tokens: Sequence[int], drafts: Sequence[int], seeded: Optional[SeededDraws]) -> int:
        """A chunk's `tokens` sampled at its 1 + len(drafts) positions: how many drafts it keeps (it emits
        tokens[:1 + that]); a seeded row's generator is wound back to its emitted positions' draws."""
        accepted = count_accepted(tokens, drafts)
        if accepted < len(drafts) and seeded is not None:
            seeded.keep(1 + accepted)
        return accepted
