"""The model runner's side of MTP drafting (`vlmrun/executor/mtp_drafter.py`): a step's chunks in, the
drafter's inputs out.

`MTPStep` follows one step: `draft` (before the model: the speculating chunks' drafts, written into
the step's input ids where their placeholders are), `catch_up` (after sampling: the MTP layer over
every fed position, on the token that follows each; a chunk whose request never drafts is left out,
`ChunkInput.feeds_drafter`), `remember` (after acceptance, on the device:
each sampling chunk's MTP output at its last kept position) and `drafts_on_host` (the drafts as lists:
their copy to the host starts, without blocking, as soon as they are made, and the list is kept, so
the grammar masks at launch and `collect` read them with one wait between them). It is the runner's
`StepDrafts` for MTP (vlmrun/executor/step_features.py); `MTPDrafting` starts one per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import torch

from vlmrun.executor.step_input import ChunkInput
from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload
from vlmrun.layers.attention.base import AttentionBackend
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.executor.mtp_drafter import DraftingChunk, MTPDrafter


@dataclass
class MTPStep:
    reads_samples: ClassVar[bool] = True  # catch-up reads the sampled ids (under TP: rank 0's, on every rank)
    drafter: MTPDrafter
    chunks: list[ChunkInput]
    backend: AttentionBackend
    device: torch.device
    tp: TensorParallel = SINGLE  # under tensor parallel, every rank feeds rank 0's drafts
    drafted: Optional[torch.Tensor] = None  # [speculating chunks, max drafts] int64 on the device
    # [fed tokens of the chunks that feed the drafter, hidden]: the MTP layer's output at each
    outputs: Optional[torch.Tensor] = None
    # `drafted` on its way to the host (on CUDA: a pinned copy and the event after it), then as lists
    _drafts_in_transit: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = field(default=None, repr=False)
    _host_drafts: Optional[list[list[int]]] = field(default=None, repr=False)

    def draft(self, fb: ForwardBatch) -> None:
        """Draft for every chunk with drafts and put them in `fb.input_ids` at the drafts' rows."""
        speculating = [i for i, c in enumerate(self.chunks) if c.num_drafts]
        if not speculating:
            return
        drafting = [DraftingChunk(c.row, c.start, c.num_drafts, c.kv_slots, c.position_ids())
                    for c in (self.chunks[i] for i in speculating)]
        self.drafted = self.tp.broadcast_from_first(self.drafter.draft(drafting, self.backend, self.device))
        starts = self._starts()
        where = [starts[i] + 1 + j for i in speculating for j in range(self.chunks[i].num_drafts)]
        which = [(k, j) for k, i in enumerate(speculating) for j in range(self.chunks[i].num_drafts)]
        at = [upload(torch.tensor(index, dtype=torch.int64), self.device) for index in zip(*which)]
        fb.input_ids[upload(torch.tensor(where, dtype=torch.int64), self.device)] = self.drafted[at[0], at[1]]
        self._start_host_copy()

    def _start_host_copy(self) -> None:
        """Start `drafted`'s copy to the host without waiting: on CUDA into pinned memory, queued right
        after the drafting kernels (before the model's), with an event to wait on."""
        if self.drafted.device.type != "cuda":
            self._drafts_in_transit = (self.drafted, None)
            return
        host = self.drafted.to("cpu", non_blocking=True)  # [speculating chunks, max drafts], pinned
        done = torch.cuda.Event()
        done.record()
        self._drafts_in_transit = (host, done)

    def catch_up(self, hidden: torch.Tensor, fb: ForwardBatch, sampled: Optional[torch.Tensor]) -> None:
        """The MTP layer over the step's fed positions; `sampled` [logits rows] the ids sampled at
        `fb.logits_indices` (None when no chunk samples)."""
        next_ids = torch.roll(fb.input_ids, -1)  # inside a chunk: the next fed token
        ends = self._starts()[1:]
        known = [(end - 1, c.next_token_id) for end, c in zip(ends, self.chunks) if c.next_token_id is not None]
        if known:  # a chunk that stops mid-sequence: the token after it, from the host
            next_ids[upload(torch.tensor([r for r, _ in known], dtype=torch.int64), self.device)] = upload(
                torch.tensor([t for _, t in known], dtype=torch.int64), self.device)
        if sampled is not None:
            next_ids[fb.logits_indices] = sampled
        fed = self._feeding()
        if not fed:
            self.outputs = None
            return
        if len(fed) < len(self.chunks):  # only the chunks whose requests draft (and prompts they may share)
            starts = self._starts()
            rows = [r for i in fed for r in range(starts[i], starts[i + 1])]
            at = upload(torch.tensor(rows, dtype=torch.int64), self.device)  # [fed tokens]
            hidden, next_ids, fb = hidden[at], next_ids[at], fb.select(fed, at, self._upload)
        self.outputs = self.drafter.catch_up(hidden, next_ids, fb, self.backend, self._starts(fed)[1:])

    def drafts_on_host(self) -> list[list[int]]:
        """Per chunk its drafts (empty for a chunk without): the first call waits for their copy to the
        host (only for the drafting, not for the model's forward queued after it); later calls cost nothing."""
        if self._host_drafts is None:
            rows: list[list[int]] = []
            if self._drafts_in_transit is not None:
                host, done = self._drafts_in_transit
                if done is not None:
                    done.synchronize()
                rows = host.tolist()
            it = iter(rows)
            self._host_drafts = [next(it)[:c.num_drafts] if c.num_drafts else [] for c in self.chunks]
            self._drafts_in_transit = None
        return self._host_drafts

    def remember(self, num_accepted: Union[None, list[int], torch.Tensor]) -> None:
        """Each sampling chunk's row keeps the MTP output at its last kept position: its last known token
        and `num_accepted[i]` accepted drafts in (per chunk; a device tensor is read without a sync; None:
        the step verified no draft)."""
        fed = self._feeding()
        starts = self._starts(fed)  # in `outputs`
        keep = [(i, self.chunks[i].row, starts[k] + self.chunks[i].num_tokens - 1 - self.chunks[i].num_drafts)
                for k, i in enumerate(fed) if self.chunks[i].sampling is not None]
        if keep:
            chunks, rows, base = (upload(torch.tensor(column, dtype=torch.int64), self.device) for column in zip(*keep))
            if num_accepted is None:
                self.drafter.remember(rows, self.outputs[base])
                return
            accepted = (num_accepted if isinstance(num_accepted, torch.Tensor)
                        else upload(torch.tensor(num_accepted, dtype=torch.int64), self.device))
            self.drafter.remember(rows, self.outputs[base + accepted[chunks]])

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        return upload(host, self.device)

    def _feeding(self) -> list[int]:
        """The chunks the MTP layer catches up over (`ChunkInput.feeds_drafter`)."""
        return [i for i, c in enumerate(self.chunks) if c.feeds_drafter]

    def _starts(self, which: Optional[list[int]] = None) -> list[int]:
        """Each chunk's first row in the stream of their fed tokens, then the stream's length: of every chunk
        (the step's token stream), or of the chunks `which` names."""
        starts = [0]
        for i in range(len(self.chunks)) if which is None else which:
            starts.append(starts[-1] + self.chunks[i].num_tokens)
        return starts


@dataclass
class MTPDrafting:
    """The runner's `Drafting` for speculative method "mtp": one `MTPStep` a step. Its catch-up runs over
    every fed position of the step, so plain decodes come as chunks (no `DecodeRows`)."""

    drafter: MTPDrafter
    backend: AttentionBackend
    device: torch.device
    tp: TensorParallel = SINGLE
    takes_decode_rows: ClassVar[bool] = False

    def start(self, chunks: list[ChunkInput]) -> MTPStep:
        return MTPStep(self.drafter, chunks, self.backend, self.device, self.tp)
