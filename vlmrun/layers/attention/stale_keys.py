"""Keys past a sequence's length, for the backends that gather whole KV pages (torch, cpu).

Those backends copy a sequence's pages whole, up to the longest sequence of the batch (or of its group),
and hide the positions past its length with the attention mask. A mask is not enough: a hidden key still
meets the softmax (score + -inf is NaN when the score is NaN) and a hidden value still meets its zero
probability (0 x NaN is NaN). Two kinds of hidden positions can hold another request's values:

- the page-table entries past a sequence's last page are stale: they name pages that an earlier
  holder of the row had, now anyone's (a running request's too);
- the tail of its last page, past its length, holds what the page's previous holder wrote there.

So, once per step, the backends point every page past a sequence's last at its own first page (finite
values of its own, hidden by the mask: `own_pages` over `own_lens`, or the cpu backend's page-table
columns; a padded verify step's last page is that of its real tokens, not of its padding, on both:
`own_lens`, the cpu backend's `page_lens`; tests/test_cpu_stale_tails.py), and both
keep the tails clear in the pool itself, one way: a step that writes a sequence's first token in a page
(its first write there: pages are filled in position order, and the prefix cache shares full pages only,
so a write into a page a sequence did not fill from its start never happens) zeroes the rest of that page
after the written tokens, each layer right after its write (`step_fresh_tails`, made once per step from the
host lengths; `KVPool.clear`). From then on the tail holds zeros or the sequence's own values (rejected
drafts), so no gathered copy needs clearing: the write is one per page a sequence takes, not one per layer
and step. A sequence shorter than a page, beside a longer one, reads its first page again past its end:
that page is its last, cleared the same way.

The slots are worked out on the host and uploaded (no device->host sync), and read by an index_fill_ of the
pool outside any CUDA graph: the torch backend is never captured (executor/bucketed_steps.py), and the
cpu backend runs on the CPU.

Clearing freed pages instead would cost a write of every page a request held, and would not cover the
stale entries that point at a running request's pages.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload


def own_pages(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_table [batch, max_pages] with each entry past a sequence's last page (its first position
    >= seq_lens[i]) replaced by the sequence's first page."""
    starts = torch.arange(page_table.shape[1], device=page_table.device) * page_size  # [max_pages]
    return torch.where(starts[None, :] < seq_lens.view(-1, 1), page_table, page_table[:, :1])


def real_lens(fb: ForwardBatch) -> Optional[np.ndarray]:
    """[batch] int64 (host) each row's real length in a padded verify step (`fb.real_fed_lens_cpu`): its prefix
    and real tokens (a padding row's: its prefix, 0 tokens). The positions past it that the row's padding holds
    write the dummy page, so the page-table entries there are stale (another request's pages). None: a step
    that is not padded, whose lengths are its own."""
    if fb.real_fed_lens_cpu is None:
        return None
    return np.add(fb.extend_prefix_lens_cpu, fb.real_fed_lens_cpu, dtype=np.int64)


def own_lens(fb: ForwardBatch) -> torch.Tensor:
    """[batch] the lengths `own_pages` takes: `fb.seq_lens`, or a padded verify step's `real_lens`."""
    real = real_lens(fb)
    return fb.seq_lens if real is None else upload(torch.from_numpy(real), fb.seq_lens.device)


def step_fresh_tails(fb: ForwardBatch, page_size: int, seq_lens: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
    """[m] KV slots (on the step's device) the pool must zero after each layer's write this step: `fresh_tail_slots`
    of any step (decodes, prefill chunks, verify chunks). `seq_lens` [batch]: `fb.seq_lens_cpu` as numpy, when the
    caller has it. A padded verify step (`fb.real_fed_lens_cpu`) counts its real tokens only: its rows' padding
    writes the dummy page, and the real tail is the one to clear."""
    lens = np.fromiter(fb.seq_lens_cpu, dtype=np.int64, count=fb.batch_size) if seq_lens is None else seq_lens
    if fb.num_tokens == fb.batch_size:  # one token each
        return fresh_tail_slots(lens, None, page_size, fb.out_cache_loc)
    extend = np.fromiter(fb.extend_seq_lens_cpu, dtype=np.int64, count=fb.batch_size)  # [batch]
    if fb.real_fed_lens_cpu is None:
        return fresh_tail_slots(lens, extend, page_size, fb.out_cache_loc)
    real = np.asarray(fb.real_fed_lens_cpu, dtype=np.int64)  # [batch] (0: a padding row)
    row_starts = np.cumsum(extend) - extend  # [batch] each row's first token row in the padded stream
    return fresh_tail_slots(real_lens(fb), real, page_size, fb.out_cache_loc, row_starts)


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
