"""Keys past a sequence's length, for the backends that gather whole KV pages (torch, cpu).

Those backends copy a sequence's pages whole, up to the longest sequence of the batch, and hide the
positions past its length with the attention mask. A mask is not enough: a hidden key still meets
the softmax (score + -inf is NaN when the score is NaN) and a hidden value still meets its zero
probability (0 x NaN is NaN). Two kinds of hidden positions can hold another request's values:

- the page-table entries past a sequence's last page are stale: they name pages that an earlier
  holder of the row had, now anyone's (a running request's too);
- the tail of its last page, past its length, holds what the page's previous holder wrote there.

So, once per step, `own_pages` points every page past a sequence's last at its own first page
(finite values of its own, hidden by the mask). The tails are cleared one of two ways:

- the torch backend lists the gathered positions that read a tail (`tail_rows`: the last page's, and
  for a sequence shorter than a page, whose first page is its last, its copies past it) and each layer
  zeroes them in its gathered copy (`zero_rows`): a few rows per sequence, not a pass over the keys;
- the cpu backend keeps the tails clear in the pool itself: a step that writes a sequence's first
  token in a page (its first write there: pages are filled in position order, and the prefix cache
  shares full pages only, so a write into a page a sequence did not fill from its start never happens)
  zeroes the rest of that page after the written tokens (`fresh_tail_slots`, `KVPool.clear`), each
  layer right after its write. From then on the tail holds zeros or the sequence's own values
  (rejected drafts), so the gathered copies need no clearing; the write is one per page a sequence
  takes, not one per layer and step.

Clearing freed pages instead would cost a write of every page a request held, and would not cover the
stale entries that point at a running request's pages.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from vlmrun.host_to_device import upload

LOOP_BELOW = 8  # sequences: below this a loop over them is quicker than numpy ops (measured, one thread)


def own_pages(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_table [batch, max_pages] with each entry past a sequence's last page (its first position
    >= seq_lens[i]) replaced by the sequence's first page."""
    starts = torch.arange(page_table.shape[1], device=page_table.device) * page_size  # [max_pages]
    return torch.where(starts[None, :] < seq_lens.view(-1, 1), page_table, page_table[:, :1])


def tail_rows(seq_lens: Sequence[int], max_seq: int, page_size: int,
              device: torch.device) -> Optional[torch.Tensor]:
    """[n] rows of a gathered [len(seq_lens) * max_seq, ...] copy (sequence i's position p at row
    i * max_seq + p) that read a position past the sequence's length, ascending; None when there are none:
    the tail of its last page, and for a sequence shorter than a page (its only page is its last one) that
    tail again in every page-sized run past it (`own_pages` reads its first page there).
    Worked out on the host (the lengths are host ints): a range per sequence for a few sequences, a few
    numpy ops over the batch from LOOP_BELOW sequences on (the quicker way there: no loop, and numpy's
    small ops cost a third of torch's)."""
    if len(seq_lens) < LOOP_BELOW:
        listed: list[int] = []
        for i, n in enumerate(seq_lens):
            listed.extend(range(i * max_seq + n, i * max_seq - (-n // page_size) * page_size))
            if n < page_size:  # its first page again in each later run
                for start in range(i * max_seq + page_size, (i + 1) * max_seq, page_size):
                    listed.extend(range(start + n, start + page_size))
        rows = torch.tensor(listed, dtype=torch.int64)
    else:
        lens = np.fromiter(seq_lens, dtype=np.int64, count=len(seq_lens))  # [batch]
        first = lens + np.arange(len(seq_lens), dtype=np.int64) * max_seq  # [batch] each tail's first row
        tail_len = (-lens) % page_size  # [batch] positions past the length in the last page (0: a full page)
        offsets = np.arange(page_size - 1, dtype=np.int64)  # [page_size - 1]
        tails = (first[:, None] + offsets)[offsets < tail_len[:, None]]  # [n] sequence by sequence
        short = np.flatnonzero(lens < page_size)  # [s] sequences of one page
        if short.size and max_seq > page_size:
            runs = np.arange(page_size, max_seq, page_size, dtype=np.int64)  # [r] first position of each later run
            copies = first[short][:, None, None] + runs[:, None] + offsets  # [s, r, page_size - 1]
            keep = np.broadcast_to((offsets < tail_len[short][:, None])[:, None, :], copies.shape)
            tails = np.sort(np.concatenate([tails, copies[keep]]))
        rows = torch.from_numpy(tails)
    return upload(rows, device) if rows.numel() else None


def zero_rows(gathered: torch.Tensor, rows: Optional[torch.Tensor], num_rows: int) -> None:
    """Zero rows `rows` of `gathered` (a fresh copy of num_rows = batch * max_seq key positions) in place."""
    if rows is not None:
        gathered.view(num_rows, -1).index_fill_(0, rows, 0)


def fresh_tail_slots(seq_lens: np.ndarray, extend_lens: Optional[np.ndarray], page_size: int,
                     out_cache_loc: torch.Tensor, row_starts: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
    """[m] KV slots (on `out_cache_loc`'s device) past each sequence's length in its last page when this
    step writes the page's first position (the sequence's first write into it): the slots the pool must
    zero after the step's write. `seq_lens` [batch]: lengths after the step (host); `extend_lens` [batch]:
    tokens each feeds (None: one each); `out_cache_loc` [num_tokens]: the slot of each fed token, the
    sequences' tokens in order; `row_starts` [batch]: each sequence's first token row in it when the rows are
    not packed (a padded verify step: row i at i * width; its real tokens first). None when no sequence
    starts a page with room left after its length."""
    last_page_start = (seq_lens - 1) // page_size * page_size  # [batch] first position of the last page
    fed = 1 if extend_lens is None else extend_lens
    fresh = np.flatnonzero((last_page_start >= seq_lens - fed) & (seq_lens % page_size != 0))  # [f]
    if not fresh.size:
        return None
    counts = (-seq_lens[fresh]) % page_size  # [f] positions past the length in the page
    if row_starts is not None:
        last_rows = (row_starts + fed - 1)[fresh]  # [f] token row of the last fed
    else:
        last_rows = fresh if extend_lens is None else (np.cumsum(extend_lens) - 1)[fresh]
    firsts = np.cumsum(counts) - counts  # [f]
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts) + 1  # [m] 1, 2, ... per sequence
    both = upload(torch.from_numpy(np.stack([np.repeat(last_rows, counts), offsets])), out_cache_loc.device)  # [2, m]
    return out_cache_loc[both[0]] + both[1]  # slots of a page are consecutive
