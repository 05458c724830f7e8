"""The step's `ForwardBatch`, made from its chunks and its plain decodes (`DecodeRows`) alone.

`build_forward_batch` lays out the step's tokens: one per decode row first (the rows the scheduler
took, in its order, before any chunk), then every chunk's fed tokens in chunk order. It touches no
cache or model; the host tensors go up with `upload` (non-blocking from pinned memory on CUDA). The
decode rows cost no Python per row beyond list concatenations: their positions, logits rows and GDN
slots are tensor ops over their columns.
`placeholder_positions` says which fed tokens the device fills in (`PLACEHOLDER_TOKEN`, async
scheduling) and from which page-table rows.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from vlmrun.cache.gdn_pool import gdn_slot_for_row
from vlmrun.executor.step_input import PLACEHOLDER_TOKEN, ChunkInput, DecodeRows, step_positions
from vlmrun.forward_batch import AttentionForward, ForwardBatch
from vlmrun.host_to_device import int64_tensor

Upload = Callable[[torch.Tensor], torch.Tensor]


def build_forward_batch(chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows], upload: Upload,
                        attn_backend: Optional[AttentionForward] = None, gdn: bool = False,
                        row_mrope_deltas: Optional[torch.Tensor] = None) -> ForwardBatch:
    """The step's ForwardBatch (`ForwardBatch.build`). Its input ids are the host's: placeholders still in,
    for the runner to fill on the device; `gdn`: the model has a GDN state pool, so each sequence gets its
    slot. The decode rows come first (one token and one logits row each), then the chunks; their positions
    read each page-table row's M-RoPE delta from `row_mrope_deltas` (host [rows], needed with decodes)."""
    n = 0 if decodes is None else len(decodes)
    if n and not chunks:  # plain decodes only: the columns as they are
        rows_t = int64_tensor(decodes.rows)  # [n]
        positions = decodes.positions(rows_t, row_mrope_deltas).contiguous()  # [3, n]
        return ForwardBatch.build(
            input_ids=int64_tensor(decodes.token_ids), positions=positions,
            req_pool_indices=rows_t, extend_prefix_lens=list(decodes.starts), extend_seq_lens=[1] * n,
            out_cache_loc=decodes.kv_slots, logits_indices=torch.arange(n, dtype=torch.int64), to_device=upload,
            attn_backend=attn_backend, state_slots=rows_t + gdn_slot_for_row(0) if gdn else None)
    input_ids: list[int] = [] if decodes is None else list(decodes.token_ids)
    logits_rows: list[int] = []
    for c in chunks:
        input_ids.extend(c.token_ids)
        if c.sampling is not None:  # the last token's position, after each draft's too
            logits_rows.extend(range(len(input_ids) - 1 - c.num_drafts, len(input_ids)))
    extend_lens = [c.num_tokens for c in chunks]
    positions = step_positions(chunks, extend_lens) if chunks else None  # [3, chunk tokens]
    prefix_lens = [c.start for c in chunks]
    rows = [c.row for c in chunks]
    slots = [c.kv_slots for c in chunks]
    logits = int64_tensor(logits_rows)  # [sampled chunk positions]
    if n:  # the decode rows before them
        extend_lens = [1] * n + extend_lens
        prefix_lens = decodes.starts + prefix_lens
        rows = decodes.rows + rows
        decode_positions = decodes.positions(int64_tensor(decodes.rows), row_mrope_deltas)  # [3, n]
        positions = decode_positions if positions is None else torch.cat([decode_positions, positions], dim=1)
        slots.insert(0, decodes.kv_slots)
        logits = torch.cat([torch.arange(n, dtype=torch.int64), logits])
    rows_t = int64_tensor(rows)  # [batch]
    return ForwardBatch.build(
        input_ids=int64_tensor(input_ids), positions=positions.contiguous(),
        req_pool_indices=rows_t, extend_prefix_lens=prefix_lens, extend_seq_lens=extend_lens,
        out_cache_loc=slots[0] if len(slots) == 1 else torch.cat(slots), logits_indices=logits, to_device=upload,
        attn_backend=attn_backend, state_slots=rows_t + gdn_slot_for_row(0) if gdn else None,  # slot = row + 1
        num_drafts=[0] * n + [c.num_drafts for c in chunks])


def placeholder_positions(chunks: Sequence[ChunkInput],
                          decodes: Optional[DecodeRows]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The fed tokens the host does not have ([k] positions in the step's tokens) and the page-table row
    whose last sampled token each is ([k]); None when there are none. A chunk's placeholder can only be
    its last known token."""
    n = 0 if decodes is None else len(decodes)
    where, rows, offset = [], [], n
    for c in chunks:
        last_known = c.num_tokens - 1 - c.num_drafts
        if c.token_ids[last_known] == PLACEHOLDER_TOKEN:
            where.append(offset + last_known)
            rows.append(c.row)
        offset += c.num_tokens
    found_where = torch.tensor(where, dtype=torch.int64)
    found_rows = torch.tensor(rows, dtype=torch.int64)
    if n:
        lane = (torch.tensor(decodes.token_ids, dtype=torch.int64) == PLACEHOLDER_TOKEN).nonzero().view(-1)  # [k']
        if lane.numel():
            found_where = torch.cat([lane, found_where])
            found_rows = torch.cat([torch.tensor(decodes.rows, dtype=torch.int64)[lane], found_rows])
    return (found_where, found_rows) if found_where.numel() else None
