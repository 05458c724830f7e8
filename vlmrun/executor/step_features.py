"""The runner's step features behind small interfaces: adapters (LoRA) and drafts (MTP), so that a new
method is a new object here, not new `if`s in `ModelRunner`'s step.

A step runs prepare -> forward -> sample -> settle (`ModelRunner.launch`). Two features join it:

- **Adapters** (`Adapters.activate(chunks, decodes) -> StepAdapters`, before the vision stage): which
  adapter each row of the step runs. `StepAdapters.vision_adapter(i)` is the slot (and encoder-cache
  tag) chunk i's images are encoded with; `bind(fb)`, just before the forward, sets every row's slot
  for the adapted layers. `NoAdapters` (the base model alone) does nothing; `LoRAAdapters` puts the
  step's adapters in slots (`vlmrun.lora.manager.LoRAManager.activate`) and binds their rows, the
  decode rows (`DecodeRows.loras`) first, then each chunk's rows as the forward runs them
  (`model_runner.rows_per_sequence`: a verify step run padded has `width` rows a sequence).
- **Drafts** (`Drafting.start(chunks) -> StepDrafts`): `draft(fb)` before the forward (the drafts
  made on the device go into the step's input ids), `catch_up(hidden, fb, sampled)` after sampling,
  `remember(accepted)` after acceptance (queued on the device), `drafts_on_host()` for the grammar
  masks and `collect`. `HostDrafting` (drafts that came from the host: the n-gram proposer's, or none)
  does nothing but hand back the chunks' own drafts; MTP's is `vlmrun.executor.mtp_steps.MTPDrafting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from vlmrun.executor.step_input import ChunkInput, DecodeRows
from vlmrun.forward_batch import ForwardBatch
from vlmrun.lora.layers import NO_ADAPTER
from vlmrun.lora.manager import LoRAManager

BASE_TOWER = (NO_ADAPTER, "")  # (slot, encoder-cache tag) of images encoded by the base vision tower


class StepAdapters(Protocol):
    """One step's adapter rows, made before its images are encoded."""

    def vision_adapter(self, chunk: int) -> tuple[int, str]:
        """The slot the vision tower runs for chunk `chunk`'s images and their encoder-cache tag
        (`BASE_TOWER`: the base tower, untagged)."""
        ...

    def bind(self, fb: ForwardBatch) -> None:
        """Every row's adapter slot for the forward that runs `fb` (read by the adapted layers)."""
        ...


class Adapters(Protocol):
    """The engine's adapters: `activate` gives a step's rows theirs."""

    def activate(self, chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows]) -> StepAdapters: ...


class NoAdapters:
    """The base model alone: no row runs an adapter (both `Adapters` and the `StepAdapters` of every step)."""

    def activate(self, chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows]) -> StepAdapters:
        return self

    def vision_adapter(self, chunk: int) -> tuple[int, str]:
        return BASE_TOWER

    def bind(self, fb: ForwardBatch) -> None:
        """Nothing to bind."""


@dataclass
class LoRAStepAdapters:
    """A step's LoRA slots: `slots` one per sequence of the step (decode rows first, then the chunks)."""

    manager: LoRAManager
    slots: list[int]  # [sequences] NO_ADAPTER: the base model
    first_chunk: int  # the chunks' first sequence (after the decode rows)
    rows_per_sequence: Callable[[ForwardBatch], Sequence[int]]

    def vision_adapter(self, chunk: int) -> tuple[int, str]:
        slot = self.slots[self.first_chunk + chunk]
        tag = self.manager.cache_tag(slot) if slot != NO_ADAPTER else ""  # the tower's adapter, or none
        return (slot, tag) if tag else BASE_TOWER

    def bind(self, fb: ForwardBatch) -> None:
        self.manager.bind(self.slots, self.rows_per_sequence(fb))


@dataclass
class LoRAAdapters:
    """LoRA adapters in slots (`enable_lora`): each step's adapters written to slots, then its rows bound.
    `rows_per_sequence(fb)`: the rows each sequence of `fb` runs as in its forward."""

    manager: LoRAManager
    rows_per_sequence: Callable[[ForwardBatch], Sequence[int]]

    def activate(self, chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows]) -> StepAdapters:
        requests = [c.lora for c in chunks]
        first_chunk = 0
        if decodes is not None and len(decodes):  # the decode rows come first in the step
            first_chunk = len(decodes)
            requests = (decodes.loras or [None] * first_chunk) + requests
        return LoRAStepAdapters(self.manager, self.manager.activate(requests), first_chunk, self.rows_per_sequence)


class StepDrafts(Protocol):
    """One step's drafts as the runner handles them. `drafted`: [speculating chunks, max drafts] on the
    device when they were made there (None: the host's, in the chunks' token ids). `reads_samples`: its
    catch-up reads the sampled ids (under tensor parallel every rank then takes rank 0's)."""

    drafted: Optional[torch.Tensor]
    reads_samples: bool

    def draft(self, fb: ForwardBatch) -> None:
        """Before the forward: drafts made on the device written into `fb.input_ids`."""
        ...

    def catch_up(self, hidden: torch.Tensor, fb: ForwardBatch, sampled: Optional[torch.Tensor]) -> None:
        """After sampling (`sampled` [logits rows], None when nothing sampled): the drafter over the step."""
        ...

    def remember(self, accepted: Optional[torch.Tensor]) -> None:
        """After acceptance, on the device: `accepted` [chunks] drafts each chunk keeps (None: no chunk verifies)."""
        ...

    def drafts_on_host(self) -> list[list[int]]:
        """Per chunk its drafts (empty for a chunk without)."""
        ...


class Drafting(Protocol):
    """How a step's drafts are made. `takes_decode_rows`: a step's plain decodes may come as `DecodeRows`."""

    takes_decode_rows: bool

    def start(self, chunks: list[ChunkInput]) -> StepDrafts: ...


@dataclass
class HostDrafts:
    """Drafts that came from the host (in the chunks' token ids) or none: nothing to do around the forward."""

    chunks: list[ChunkInput]
    drafted: Optional[torch.Tensor] = None
    reads_samples: bool = False

    def draft(self, fb: ForwardBatch) -> None:
        """Already in the token ids."""

    def catch_up(self, hidden: torch.Tensor, fb: ForwardBatch, sampled: Optional[torch.Tensor]) -> None:
        """No drafter to catch up."""

    def remember(self, accepted: Optional[torch.Tensor]) -> None:
        """Nothing kept on the device."""

    def drafts_on_host(self) -> list[list[int]]:
        return [c.draft_token_ids for c in self.chunks]


class HostDrafting:
    """No drafter in the runner: the n-gram proposer's drafts (in the chunks) or no speculation."""

    takes_decode_rows = True

    def start(self, chunks: list[ChunkInput]) -> StepDrafts:
        return HostDrafts(chunks)
