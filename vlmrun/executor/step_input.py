"""What the model runner is given for one step: one `ChunkInput` per scheduled request.

The scheduler decides the chunks and writes the cache bookkeeping for them (page table rows, KV
slots, a fresh request's zeroed GDN slot) before the step; the engine turns each scheduled chunk
into a `ChunkInput`. The runner only reads these and the caches, so the types it needs live here,
below the engine.

The plain decodes of a step (a request past its prompt feeding its last token, no drafts, no grammar,
no `min_tokens`, which counts outputs still on the device) come as one `DecodeRows` instead: a
column per field, so the step's host work for them does not make an object per request. They come
first in the step's token order (the scheduler takes them before any chunk, so the order of the rows,
and with it which noise an unseeded sampled row draws, is the order a step of chunks alone has).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from vlmrun.forward_batch import PLACEHOLDER_TOKEN  # in `ChunkInput.token_ids` (re-exported)
from vlmrun.host_to_device import int64_tensor
from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.lora.request import LoRARequest
from vlmrun.pooling.pooler import ChunkPooling
from vlmrun.spec_decode.grammar import DraftGrammar, FilledDraftGrammar


__all__ = ["PLACEHOLDER_TOKEN", "ChunkInput", "DecodeRows", "PromptLogprobTargets", "step_positions"]


@dataclass
class PromptLogprobTargets:
    """A chunk of a request that asked for prompt logprobs: the prompt token that follows each of its
    first fed tokens (every fed prompt token but the prompt's last), whose logprob and top-k it gets."""

    num_logprobs: int  # top-k beside the prompt token
    next_token_ids: list[int]  # [m] prompt ids at positions start + 1 .. start + m


@dataclass
class ChunkInput:
    row: int  # the request's ReqToTokenPool row (its GDN slot is gdn_slot_for_row(row))
    start: int  # tokens of the request already in the cache
    token_ids: list[int]  # tokens fed this step; the last may be PLACEHOLDER_TOKEN, read on the device
    # [3, num_tokens] int64 M-RoPE positions of the fed tokens (CPU) when the chunk overlaps the prompt;
    # None past it: token i's position is start + i + mrope_delta on all three rows (`position_ids`), and
    # the runner builds those of every such chunk of a step in one tensor op
    positions: Optional[torch.Tensor]
    kv_slots: torch.Tensor  # [num_tokens] int64 KV slots the fed tokens write (CPU)
    mm_items: Sequence  # processors.MMItem of the request's prompt when the chunk overlaps it, else ()
    sampling: Optional[SamplingRow] = None  # set when the chunk reaches the last known token: sample after it
    prompt_logprobs: Optional[PromptLogprobTargets] = None  # set when the request asked for prompt logprobs
    # speculative decoding: the last `num_drafts` of token_ids are drafts after the last known token;
    # the chunk samples at each of its last 1 + num_drafts positions (vlmrun/spec_decode/verify.py)
    num_drafts: int = 0
    # a speculating chunk of a request with a grammar: its masks after the drafts (spec_decode/grammar.py)
    draft_grammar: Optional[Union[DraftGrammar, FilledDraftGrammar]] = None
    # a chunk that stops before the request's last known token: the token after it (MTP drafting reads it)
    next_token_id: Optional[int] = None
    lora: Optional[LoRARequest] = None  # the request's LoRA adapter (None: the base model)
    # MTP: the layer catches up over this chunk (False: its request never drafts, `Request.speculates`, and
    # the prefix cache keeps none of these positions for a request that will)
    feeds_drafter: bool = True
    mrope_delta: int = 0  # the request's M-RoPE offset of positions after its prompt (read when positions is None)
    pooling: Optional[ChunkPooling] = None  # a pooling (embedding) request's chunk: pool its final hidden states

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def position_ids(self) -> torch.Tensor:
        """[3, num_tokens] int64 M-RoPE positions of the fed tokens (CPU)."""
        if self.positions is not None:
            return self.positions
        first = self.start + self.mrope_delta
        return torch.arange(first, first + len(self.token_ids), dtype=torch.int64).expand(3, -1)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts:]


@dataclass
class DecodeRows:
    """A step's plain decodes as columns: row i feeds one token (its request's last known one) and samples after it."""

    rows: list[int]  # [n] ReqToTokenPool rows
    starts: list[int]  # [n] tokens of each request already in the cache (its fed token's position before M-RoPE)
    token_ids: list[int]  # [n] the fed tokens; PLACEHOLDER_TOKEN: on the device, in the runner's last_tokens
    kv_slots: torch.Tensor  # [n] int64 KV slots the fed tokens write (CPU)
    sampling: list[SamplingRow]  # [n] each request's sampling row, made once when it was admitted
    loras: Optional[list[Optional[LoRARequest]]] = None  # [n] each request's LoRA adapter; None: no row has one

    def __len__(self) -> int:
        return len(self.rows)

    def positions(self, rows: torch.Tensor, row_mrope_deltas: torch.Tensor) -> torch.Tensor:
        """[3, n] int64 M-RoPE positions of the fed tokens (CPU): start + the request's M-RoPE delta on all
        three rows. `rows` [n] is `self.rows` as a tensor; `row_mrope_deltas` [page-table rows] the delta of
        each row's request, kept by the runner (`ModelRunner.row_mrope_deltas`): no list per request."""
        return (int64_tensor(self.starts) + row_mrope_deltas[rows]).expand(3, -1)  # [3, n]


def step_positions(chunks: Sequence[ChunkInput], num_tokens: list[int]) -> torch.Tensor:
    """The step's M-RoPE positions [3, sum(num_tokens)] int64 (CPU): one tensor op for every chunk past its
    prompt (`start + i + mrope_delta`), the prompt chunks' own positions copied over theirs."""
    firsts = torch.tensor([c.start + c.mrope_delta for c in chunks], dtype=torch.int64)  # [chunks]
    if all(n == 1 for n in num_tokens):  # decode: one token a chunk
        generated = firsts
    else:  # token j of chunk i: firsts[i] + j
        lens = torch.tensor(num_tokens, dtype=torch.int64)  # [chunks]
        chunk_starts = torch.cumsum(lens, 0) - lens  # [chunks] each chunk's first token in the step
        total = int(sum(num_tokens))
        generated = (torch.repeat_interleave(firsts - chunk_starts, lens, output_size=total)
                     + torch.arange(total, dtype=torch.int64))  # [tokens]
    positions = generated.expand(3, -1).contiguous()  # [3, tokens]
    offset = 0
    for c, n in zip(chunks, num_tokens):
        if c.positions is not None:
            positions[:, offset:offset + n] = c.positions
        offset += n
    return positions
