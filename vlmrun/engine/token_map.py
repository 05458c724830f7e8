"""The step's page-table writes (`map_tokens`): the KV slot of every token a step feeds, written into its
request's page-table row in one copy for the step, and handed to each chunk and to the decode rows.

A chunk's slots are worked out here as host ints (a request admitted this step also gets the rows of its
cached prefix, a prefix-cache hit); the decode rows' (first in the step) were worked out as they were
picked (`ScheduledDecodes`: numpy columns, or host ints for a few rows). The step's become one tensor, and
each chunk's are a view of it.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from vlmrun.cache.kv_pool import PageTable, token_slots
from vlmrun.engine.scheduled_chunk import ScheduledChunk, ScheduledDecodes
from vlmrun.host_to_device import int64_tensor


def map_tokens(chunks: list[ScheduledChunk], decodes: ScheduledDecodes, page_size: int, page_table: PageTable) -> None:
    """Set the KV slots of the step's decode rows and chunks, and write them into the page table."""
    rows: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sizes: list[int] = [len(decodes)]  # the decodes' slots, then per chunk its slots in `slots`
    for c in chunks:
        req, start = c.request, c.start
        end = start + c.num_tokens
        first = 0 if c.admitted else start  # (a prefix-cache hit's rows, then the fed tokens')
        sizes.append(end - first)
        if end - first == 1:  # a decode: one token, one slot
            rows.append(req.req_pool_idx)
            positions.append(first)
            slots.append(req.pages[first // page_size] * page_size + first % page_size)
            continue
        rows.extend([req.req_pool_idx] * (end - first))
        positions.extend(range(first, end))
        slots.extend(token_slots(req.pages, first, end, page_size))
    if not slots and not decodes:
        return
    step_rows, step_positions, step_slots = map(step_column, decodes.host_columns(), (rows, positions, slots))
    pieces = step_slots.split(sizes) if chunks else (step_slots,)
    decodes.kv_slots = pieces[0]
    for c, size, piece in zip(chunks, sizes[1:], pieces[1:]):
        c.kv_slots = piece if size == c.num_tokens else piece[size - c.num_tokens:]
    page_table.write(step_rows, step_positions, step_slots)


def step_column(decodes: Union[np.ndarray, list[int]], chunks: list[int]) -> torch.Tensor:
    """[n + m] int64 host tensor of a step's column: the decodes' values (numpy, or host ints), then the chunks'."""
    if isinstance(decodes, list):
        return int64_tensor(decodes + chunks)
    return torch.from_numpy(np.concatenate([decodes, np.array(chunks, dtype=np.int64)]) if chunks else decodes)
