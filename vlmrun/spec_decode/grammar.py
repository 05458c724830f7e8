"""Structured outputs with drafts: the grammar mask of each verified position.

Position j of a verify pass (after the request's last token and drafts[:j]) is sampled as plain
decode would sample it once drafts[:j] had been accepted, so it is masked by the grammar state after
those drafts. `DraftGrammar.after_drafts` advances the request's grammar (a `GrammarState`, or a
`ReasoningGate` in front of one) over the drafts, takes each position's mask on the way, and restores
it (xgrammar's rollback: cheap, where a fork copies the matcher's whole history); once it returns the
request's state is as it was, and advances (in the engine) only over the tokens the step gives. The
engine is single-threaded, so nothing sees the state in between. A draft the grammar forbids is masked
out at its own position, so the sampler
cannot pick it there and it is rejected; the positions behind it are never reached (their tokens are
dropped) and sample unmasked, as do positions after a draft that ended the grammar. Under tensor
parallelism the driver makes the masks (`DraftGrammar.filled`: the drafts are on the host there) and
the ranks get them, as they get a grammar's next-token mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vlmrun.structured.compiler import FilledBitmask

Masks = list[Optional[FilledBitmask]]  # per position after a draft: its mask, None for no mask


@dataclass(frozen=True)
class DraftGrammar:
    """A speculating request's grammar: the engine's `GrammarState` or `ReasoningGate`, left as it was found."""

    state: Any

    def after_drafts(self, drafts: Sequence[int]) -> Masks:
        """The mask of positions 1 .. len(drafts): position j + 1 follows drafts[:j + 1]."""
        state, masks = self.state, []
        checkpoint = state.checkpoint()
        try:
            reachable = True
            for token in drafts:
                reachable = reachable and state.accept(token) and not state.is_terminated
                masks.append(state.filled() if reachable and state.constraining else None)
        finally:
            state.restore(checkpoint)
        return masks

    def filled(self, drafts: Sequence[int]) -> "FilledDraftGrammar":
        """The masks after `drafts` made here, for a process that has no matcher (a tensor-parallel rank)."""
        return FilledDraftGrammar(tuple(self.after_drafts(drafts)))


@dataclass(frozen=True)
class FilledDraftGrammar:
    """`DraftGrammar.after_drafts` made in advance, for the drafts it was made for."""

    masks: tuple[Optional[FilledBitmask], ...]

    def after_drafts(self, drafts: Sequence[int]) -> Masks:
        if len(drafts) != len(self.masks):
            raise ValueError(f"masks made for {len(self.masks)} drafts, asked for {len(drafts)}")
        return list(self.masks)
