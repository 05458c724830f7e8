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
from vlmrun.forward_batch import AttentionForward, ForwardBatch, ForwardMode

Upload = Callable[[torch.Tensor], torch.Tensor]


def build_forward_batch(chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows], upload: Upload,
                        attn_backend: Optional[AttentionForward] = None, gdn: bool = False) -> ForwardBatch:
    """The step's ForwardBatch (input ids as the host has them: placeholders still in; `gdn`: the model
    has a GDN state pool, so each sequence gets its slot). The decode rows come first (one token and one
    logits row each), then the chunks."""
    n = 0 if decodes is None else len(decodes)
    input_ids: list[int] = [] if decodes is None else list(decodes.token_ids)
    logits_rows: list[int] = []
    for c in chunks:
        input_ids.extend(c.token_ids)
        if c.sampling is not None:  # the last token's position, after each draft's too
            logits_rows.extend(range(len(input_ids) - 1 - c.num_drafts, len(input_ids)))
    if n:
        extend_lens = [1] * n + [c.num_tokens for c in chunks]
        prefix_lens = decodes.starts + [c.start for c in chunks]
        seq_lens = [s + 1 for s in decodes.starts] + [c.end for c in chunks]
        rows = decodes.rows + [c.row for c in chunks]
        parts = [decodes.positions()] + ([step_positions(chunks, extend_lens[n:])] if chunks else [])
        positions = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [3, tokens]
        slots = [decodes.kv_slots] + [c.kv_slots for c in chunks]
        logits = torch.cat([torch.arange(n, dtype=torch.int64), torch.tensor(logits_rows, dtype=torch.int64)])
    else:
        extend_lens = [c.num_tokens for c in chunks]
        prefix_lens = [c.start for c in chunks]
        seq_lens = [c.end for c in chunks]
        rows = [c.row for c in chunks]
        positions = step_positions(chunks, extend_lens)  # [3, tokens]
        slots = [c.kv_slots for c in chunks]
        logits = torch.tensor(logits_rows, dtype=torch.int64)  # [sampled positions]
    rows_t = torch.tensor(rows, dtype=torch.int64)  # [batch]
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if len(input_ids) == len(rows) else ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),  # [tokens] (host: the caller fills placeholders)
        positions=upload(positions.contiguous()),
        req_pool_indices=upload(rows_t),
        seq_lens=upload(torch.tensor(seq_lens, dtype=torch.int64)),
        extend_prefix_lens=upload(torch.tensor(prefix_lens, dtype=torch.int64)),
        extend_seq_lens=upload(torch.tensor(extend_lens, dtype=torch.int64)),
        out_cache_loc=upload(slots[0] if len(slots) == 1 else torch.cat(slots)),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
        logits_indices=upload(logits),
        attn_backend=attn_backend,
    )
    if gdn:
        fb.state_slots = upload(rows_t + gdn_slot_for_row(0))  # [batch] slot = row + 1
    if any(c.num_drafts for c in chunks):
        fb.num_drafts_cpu = [0] * n + [c.num_drafts for c in chunks]
    return fb


def placeholder_positions(chunks: Sequence[ChunkInput], decodes: Optional[DecodeRows],
                          host_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The fed tokens the host does not have ([k] positions in the step's tokens) and the page-table row
    whose last sampled token each is ([k]); None when there are none. `host_ids` [tokens] is the step's
    input ids as built on the host. A chunk's placeholder can only be its last known token."""
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
        lane = (host_ids[:n] == PLACEHOLDER_TOKEN).nonzero().view(-1)  # [k'] decode rows with a placeholder
        if lane.numel():
            found_where = torch.cat([lane, found_where])
            found_rows = torch.cat([torch.tensor(decodes.rows, dtype=torch.int64)[lane], found_rows])
    return (found_where, found_rows) if found_where.numel() else None
