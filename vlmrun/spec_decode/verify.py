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
"""

from __future__ import annotations

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
