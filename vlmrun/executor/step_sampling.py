"""A step's sampling batch from the runner's per-row `SamplingState`, and the step's tokens back into it.

`StepSampling.of` says which page-table row each sampled position reads: the decode rows' and the
sampling chunks' in step order, or, in a speculative verify step, the decode rows' (one position each,
first) then each request's row at its 1 + d positions with drafts[:j] appended at position j. An MTP
verify step (its drafts are on the device, placeholders in the rows; it has no decode rows) is built from
the rows with `SamplingBatch.build`. After sampling, `record` adds the tokens the requests keep to their
rows' penalty counts on the device: one per request, or in a verify step one per decode row and each
chunk's first 1 + accepted (the acceptance computed on the device, no sync, once a step: the runner's
`settle_on_device` reads the same tensor, `Verification.accepted_on_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

import torch

from vlmrun.executor.step_input import ChunkInput, DecodeRows
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.layers.sampling_state import GatheredStep, SamplingState, emitted_positions
from vlmrun.spec_decode.verify import Verification


@dataclass
class StepSampling:
    """One step's batch and what `record` needs of it."""

    batch: SamplingBatch
    gathered: Optional[GatheredStep] = None  # None: built from the rows (an MTP verify step)
    verification: Optional[Verification] = None
    spans: Sequence[int] = ()  # verify step: each chunk's positions (1 + drafts; 0 when it does not sample)
    num_decodes: int = 0  # verify step: the decode rows before the chunks' positions, one position each

    @classmethod
    def of(cls, state: SamplingState, rows: list[SamplingRow], vocab_size: int, chunks: Sequence[ChunkInput],
           decodes: Optional[DecodeRows], verification: Optional[Verification], drafts_on_device: bool,
           device: torch.device) -> "StepSampling":
        """`rows`: the step's sampling rows in order (the decode rows first; a verify step's per position)."""
        decode_rows: list[int] = [] if decodes is None else decodes.rows
        if verification is None:
            chunk_rows = [c.row for c in chunks if c.sampling is not None]
            gathered = state.gather(decode_rows + chunk_rows if chunk_rows else decode_rows, rows, vocab_size)
            return cls(gathered.batch, gathered)
        if drafts_on_device:
            return cls(SamplingBatch.build(rows, vocab_size, device=device), verification=verification)
        spans = [1 + c.num_drafts if c.sampling is not None else 0 for c in chunks]
        page_rows = decode_rows + [c.row for c, k in zip(chunks, spans) for _ in range(k)]
        appended = [()] * len(decode_rows) + [c.draft_token_ids[:j] for c, k in zip(chunks, spans) for j in range(k)]
        gathered = state.gather(page_rows, rows, vocab_size, appended=appended)
        return cls(gathered.batch, gathered, verification, spans, len(decode_rows))

    def record(self, state: SamplingState, token_ids: torch.Tensor, device: torch.device) -> None:
        """The step sampled `token_ids` [positions] (on the device): its penalty rows' counts take the kept ones."""
        if self.gathered is None or self.gathered.penalty_rows is None:
            return
        emitted = None
        if self.verification is not None:
            first_rows = [self.num_decodes + row for row in accumulate(self.spans[:-1], initial=0)]
            accepted = self.verification.accepted_on_device(token_ids, first_rows, None, device)  # [chunks]
            emitted = emitted_positions(accepted, self.spans, device, self.num_decodes)  # [positions]
        state.record(self.gathered, token_ids, emitted)
