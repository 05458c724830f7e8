"""Structured outputs after reasoning: the model thinks freely in `<think>…</think>`, the grammar holds after.

`ReasoningMarkers` are the reasoning delimiters of a tokenizer (Qwen's `<think>` / `</think>`): their
text, and their canonical token ids (one id each for Qwen3 / Qwen3.5 tokenizers, several for a
tokenizer without those tokens).

`ReasoningGate` wraps one request's `GrammarState` (or none, for a request that only has a
thinking budget) and moves through phases, decided first by the prompt (`start_phase`):

- `CONSTRAINED`: the grammar masks every token and is advanced by every token. The start when the
  prompt ends with `</think>` (a template with thinking turned off), or when it ends with neither
  marker and the tokenizer has no single `<think>` token.
- `THINKING`: no mask, the grammar is not advanced; the text of each token is watched for
  `</think>`, and the grammar starts fresh after the token that completes it (text that token carries
  after the marker, newlines dropped, is fed to the grammar as a string). The start when the prompt
  ends inside `<think>` (thinking templates). With `budget` reasoning tokens spent, `</think>` is
  forced.
- `OPENING` (prompt ends with neither marker, and `<think>` is one token): the grammar's mask plus the
  `<think>` token; sampling `<think>` starts `THINKING`, anything else is the grammar's first token.
- `FORCING`: only the next token of a forced sequence (the rest of a `<think>` spelled in several
  tokens, or `</think>` at the budget) is allowed; then the phase it was forcing towards.

The gate is replayable: a fresh gate for the same prompt fed the same output tokens reaches the same
state, and tokens before the think end never reach the matcher. The engine keeps a preempted
request's gate (its tokens are recomputed, not resampled), so nothing is rolled back.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional

import torch

from vlmrun.structured.compiler import FilledBitmask, GrammarState, bitmask_words

logger = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Phase(Enum):
    OPENING = "opening"
    THINKING = "thinking"
    FORCING = "forcing"
    CONSTRAINED = "constrained"


@dataclass(frozen=True)
class ReasoningMarkers:
    """The reasoning delimiters of one tokenizer: text and canonical token ids."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    token_text: Callable[[int], str]  # one token's text, special tokens kept
    open_text: str = THINK_OPEN
    close_text: str = THINK_CLOSE

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, open_text: str = THINK_OPEN,
                       close_text: str = THINK_CLOSE) -> "ReasoningMarkers":
        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        return cls(encode(open_text), encode(close_text), token_text, open_text, close_text)

    @property
    def single_open_token(self) -> Optional[int]:
        """The id of `<think>` when it is one token (then a model can open a think unambiguously)."""
        return self.open_ids[0] if len(self.open_ids) == 1 else None

    def start_phase(self, prompt_text: str) -> Phase:
        """Where an output starts, from the end of its prompt (see the module docstring)."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.close_text):
            return Phase.CONSTRAINED
        if tail.endswith(self.open_text):
            return Phase.THINKING
        return Phase.OPENING if self.single_open_token is not None else Phase.CONSTRAINED


@dataclass
class ReasoningGate:
    """One request's reasoning phase in front of its grammar (see the module docstring).

    Has the `GrammarState` interface the engine and the sampler use: `constraining` (False: the
    sampler applies no mask this step), `fill_bitmask`, `filled`, `accept`, `is_terminated`, `checkpoint`
    and `restore`."""

    markers: ReasoningMarkers
    grammar: Optional[GrammarState]
    vocab_size: int
    phase: Phase = Phase.CONSTRAINED
    budget: Optional[int] = None  # reasoning tokens before `</think>` is forced; None: no limit
    num_reasoning_tokens: int = 0
    _forced: list[int] = field(default_factory=list)  # FORCING: the tokens still to force
    _after_forcing: Phase = Phase.THINKING
    _tail: str = ""  # THINKING: the end of the reasoning text, as long as the close marker

    @classmethod
    def for_prompt(cls, markers: ReasoningMarkers, grammar: Optional[GrammarState], vocab_size: int,
                   prompt_text: str, budget: Optional[int] = None) -> "ReasoningGate":
        gate = cls(markers, grammar, vocab_size, markers.start_phase(prompt_text), budget)
        if gate.phase == Phase.THINKING:
            gate._check_budget()
        return gate

    # ------------------------------------------------------------------ what the sampler reads

    @property
    def constraining(self) -> bool:
        """True when this step's logits get a mask (every phase but free thinking)."""
        if self.phase == Phase.FORCING:
            return True
        return self.phase != Phase.THINKING and self.grammar is not None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, CPU)."""
        if self.phase == Phase.FORCING:
            _only(bitmask, row, self._forced[0])
        elif self.phase == Phase.THINKING or self.grammar is None:
            bitmask[row] = -1
        else:
            self.grammar.fill_bitmask(bitmask, row)
            if self.phase == Phase.OPENING:
                _allow(bitmask, row, self.markers.open_ids[0])

    def filled(self) -> FilledBitmask:
        words = torch.full((1, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        self.fill_bitmask(words, 0)
        return FilledBitmask(words[0])

    # ------------------------------------------------------------------ what the engine calls

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the current phase does not allow it."""
        if self.phase == Phase.FORCING:
            return self._accept_forced(token_id)
        if self.phase == Phase.THINKING:
            self._accept_thinking(token_id)
            return True
        if self.phase == Phase.OPENING:
            return self._accept_opening(token_id)
        return self.grammar is None or self.grammar.accept(token_id)

    def checkpoint(self) -> "GateCheckpoint":
        """The phase and the grammar's state now, for `restore` (speculative decoding walks the request's
        own gate over drafts, then back)."""
        return GateCheckpoint(dataclasses.replace(self, _forced=list(self._forced)),
                              None if self.grammar is None else self.grammar.checkpoint())

    def restore(self, checkpoint: "GateCheckpoint") -> None:
        """Back to `checkpoint` (once): the phase and its counters, and the grammar's steps rolled back."""
        saved = checkpoint.gate
        self.phase, self.num_reasoning_tokens, self._forced = saved.phase, saved.num_reasoning_tokens, saved._forced
        self._after_forcing, self._tail = saved._after_forcing, saved._tail
        if self.grammar is not None:
            self.grammar.restore(checkpoint.grammar)

    @property
    def is_terminated(self) -> bool:
        return self.phase == Phase.CONSTRAINED and self.grammar is not None and self.grammar.is_terminated

    @property
    def reasoning_ended(self) -> bool:
        return self.phase == Phase.CONSTRAINED

    # ------------------------------------------------------------------ phases

    def _accept_opening(self, token_id: int) -> bool:
        """The grammar's reading of the first token wins; else `<think>` opens a think."""
        if self.grammar is not None and self.grammar.accept(token_id):
            self.phase = Phase.CONSTRAINED
            return True
        if token_id == self.markers.open_ids[0]:
            self._force(list(self.markers.open_ids[1:]), then=Phase.THINKING)
            return True
        if self.grammar is None:
            self.phase = Phase.CONSTRAINED
            return True
        return False

    def _accept_thinking(self, token_id: int) -> None:
        self.num_reasoning_tokens += 1
        close = self.markers.close_text
        text = self._tail + self.markers.token_text(token_id)
        at = text.find(close)
        if at < 0:
            self._tail = text[-(len(close) - 1):] if len(close) > 1 else ""
            self._check_budget()
            return
        self._start_grammar(text[at + len(close):].lstrip("\n"))

    def _start_grammar(self, carried: str = "") -> None:
        """`</think>` is out: the grammar starts, with the text the closing token carried past it."""
        self.phase, self._tail = Phase.CONSTRAINED, ""
        if carried and self.grammar is not None and not self.grammar.accept_string(carried):
            logger.warning("the token that closed the reasoning carried %r, which its grammar refuses", carried)

    def _check_budget(self) -> None:
        if self.budget is not None and self.num_reasoning_tokens >= self.budget:
            self._force(list(self.markers.close_ids), then=Phase.CONSTRAINED)

    def _force(self, tokens: list[int], then: Phase) -> None:
        if not tokens:
            self._enter(then)
            return
        self.phase, self._forced, self._after_forcing = Phase.FORCING, tokens, then

    def _accept_forced(self, token_id: int) -> bool:
        if token_id != self._forced[0]:
            return False
        self._forced.pop(0)
        if not self._forced:
            self._enter(self._after_forcing)
        return True

    def _enter(self, phase: Phase) -> None:
        if phase == Phase.CONSTRAINED:
            self._start_grammar()
        else:
            self.phase = phase
            self._check_budget()


@dataclass(frozen=True)
class GateCheckpoint:
    """`ReasoningGate.checkpoint`: a copy of the gate's fields (sharing its grammar) and the grammar's checkpoint."""

    gate: ReasoningGate
    grammar: Optional[int]


def _only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    bitmask[row] = 0
    _allow(bitmask, row, token_id)


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    if word < bitmask.shape[1]:
        value = int(bitmask[row, word]) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


def split_reasoning(text: str, prompt_text: str = "", markers: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)
                    ) -> tuple[str, str]:
    """(reasoning, content) of an output: the part in `<think>…</think>` (a leading `<think>`, or from
    the start when the prompt ended inside one, or when the output has a `</think>` but no `<think>`
    before it) and what follows, leading newlines dropped. An unclosed think is all reasoning."""
    open_text, close_text = markers
    close_at = text.find(close_text)
    thinking = prompt_text.rstrip().endswith(open_text) or (close_at >= 0 and open_text not in text[:close_at])
    if text.startswith(open_text):
        text, thinking = text[len(open_text):], True
    if not thinking:
        return "", text
    end = text.find(close_text)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(close_text):].lstrip("\n")
