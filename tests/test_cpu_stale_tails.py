"""The cpu and torch backends keep another request's NaN out of a sequence's attention over many steps
(stale_keys.py).

A pool whose every slot holds NaN (what a request whose activations overflowed leaves behind) and
page-table rows whose stale entries name such pages: sequences are prefilled on fresh pages, then
decode across page boundaries, a late one prefills beside the decodes, one verifies drafts (most of them
rejected: its page then holds its own values past its length), one starts from a prefix-cache hit (a full
page of another sequence's) and prefills the rest. Both backends gather whole pages and clear no copy: the
step that writes a page's first position zeroes the rest of it in the pool (`step_fresh_tails`,
`KVPool.clear`). Every step's output must be finite and equal the torch backend's over a clean pool
(zeros), float32 and a float8 pool. (A sequence shorter than a page, in a batch with a longer one, reads
its first page again past its end: zeroing the last page's tail in a gathered copy alone missed those.)
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from tests.kernel_builds import require_paged_decode
from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, token_slots
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.stale_keys import fresh_tail_slots, step_fresh_tails
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

PAGE, HEADS, KV_HEADS, HEAD_DIM, NUM_PAGES = 4, 4, 2, 8, 40


class Sequences:
    """Requests on one poisoned pool and page table: each step's ForwardBatch, pages taken as positions need them."""

    def __init__(self, dtype: torch.dtype, backend_cls, poisoned: bool, seed: int = 0):
        self.pool = KVPool(1, NUM_PAGES * PAGE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), PAGE,
                           compute_dtype=torch.float32)
        for buffer in self.pool.k_buffers + self.pool.v_buffers:
            buffer.copy_(torch.full(buffer.shape, float("nan") if poisoned else 0.0).to(dtype))
        self.rows = ReqToTokenPool(4, 64, torch.device("cpu"))
        self.free = list(range(1, NUM_PAGES))
        random.Random(seed).shuffle(self.free)
        # stale entries: every row first maps its positions to slots of pages a NaN request held
        self.rows.req_to_token[:4] = torch.tensor(token_slots(self.free[-16:], 0, 64, PAGE))
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.backend = backend_cls(self.pool, self.rows)

    def share(self, row: int, owner: int, pages: int) -> None:
        """Row `row` starts from a prefix-cache hit: the first `pages` (full) pages of row `owner`."""
        self.pages[row] = self.pages[owner][:pages]
        self.lens[row] = pages * PAGE
        self.rows.req_to_token[row, :pages * PAGE] = self.rows.req_to_token[owner, :pages * PAGE]

    def reject(self, row: int, drafts: int) -> None:
        """Row `row`'s last `drafts` positions were rejected drafts: its length goes back (their k/v stay)."""
        self.lens[row] -= drafts

    def step(self, fed: dict[int, int], drafts: dict[int, int] | None = None) -> ForwardBatch:
        """A step where row r feeds fed[r] tokens (its last drafts[r] of them drafts)."""
        out_loc, prefix_lens = [], []
        for row, n in fed.items():
            start = self.lens.get(row, 0)
            pages = self.pages.setdefault(row, [])
            while len(pages) * PAGE < start + n:
                pages.append(self.free.pop(0))
            slots = token_slots(pages, start, start + n, PAGE)
            self.rows.req_to_token[row, start:start + n] = torch.tensor(slots)
            out_loc += slots
            prefix_lens.append(start)
            self.lens[row] = start + n
        extend_lens = list(fed.values())
        num_tokens = sum(extend_lens)
        long = dict(dtype=torch.int64)
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND,
            input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(3, num_tokens, **long),
            req_pool_indices=torch.tensor(list(fed), **long), seq_lens=torch.tensor(seq_lens, **long),
            extend_prefix_lens=torch.tensor(prefix_lens, **long), extend_seq_lens=torch.tensor(extend_lens, **long),
            out_cache_loc=torch.tensor(out_loc, **long), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens, logits_indices=torch.zeros(0, **long),
            num_drafts_cpu=[(drafts or {}).get(r, 0) for r in fed] if drafts else None)
        fb.attn_backend = self.backend
        return fb


# (row -> tokens fed) per step; the rows' lengths cross page boundaries (PAGE = 4) on different steps; step 1
# decodes row 1 (3 tokens, one page) beside row 0 (6): row 1 reads its first page again past its end
STEPS = [{0: 5, 1: 2}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1, 2: 7}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 2, 2: 1},
         {0: 1, 1: 4, 2: 1}, {0: 1, 2: 1, 3: 3}, {0: 1, 2: 1, 3: 1}, {0: 1, 1: 1, 3: 1}]
DRAFTS = {6: {1: 3}}  # step 6: row 1 (8 tokens) verifies 3 drafts (the torch backend runs it as an extend chunk) ...
REJECTED = {6: {1: 3}}  # ... all rejected: positions 10, 11 keep its drafts' k/v, hidden from its decode at step 9
SHARED = {7: (3, 0, 1)}  # before step 7: row 3 takes row 0's first page (full) from the prefix cache


def run_steps(ours: Sequences, ref: Sequences) -> None:
    """STEPS on both; each step's output of `ours` finite and equal to `ref`'s."""
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gen = torch.Generator().manual_seed(3)
    for i, fed in enumerate(STEPS):
        for seqs in (ours, ref):
            if i in SHARED:
                seqs.share(*SHARED[i])
        fb_ours, fb_ref = ours.step(fed, DRAFTS.get(i)), ref.step(fed)  # (the reference runs a verify chunk as an extend)
        n = fb_ours.num_tokens
        q = torch.randn(n, HEADS * HEAD_DIM, generator=gen)
        k = torch.randn(n, KV_HEADS * HEAD_DIM, generator=gen)
        v = torch.randn(n, KV_HEADS * HEAD_DIM, generator=gen)
        ours.backend.prepare(fb_ours)
        ref.backend.prepare(fb_ref)
        got = ours.backend.forward(q, k, v, layer, fb_ours)
        expected = ref.backend.forward(q, k, v, layer, fb_ref)
        assert got.isfinite().all(), f"step {i}: NaN reached a sequence"
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for seqs in (ours, ref):
            for row, drafts in REJECTED.get(i, {}).items():
                seqs.reject(row, drafts)


def backend_class(name: str):
    """The backend by name: "cpu" gathers its decode rows' pages, "cpu-paged" reads them with the paged decode
    kernel (a float8 pool gathers either way), "torch" is the reference."""
    if name == "cpu-paged":
        return functools.partial(CpuAttnBackend, paged_decode=require_paged_decode())
    return {"cpu": CpuAttnBackend, "torch": TorchAttnBackend}[name]


@pytest.mark.parametrize("backend", ["cpu", "cpu-paged", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_no_nan_from_a_poisoned_pool_over_steps(dtype, backend):
    run_steps(Sequences(dtype, backend_class(backend), poisoned=True), Sequences(dtype, TorchAttnBackend, poisoned=False))


def test_fresh_tail_slots_are_the_rest_of_each_page_a_step_starts():
    """Worked out from host lengths: decodes (one token each) and a mixed step's chunks."""
    loc = torch.arange(100, 112)  # [tokens] the fed tokens' slots
    lens = np.array([5, 8, 9, 3])  # decodes: 5 and 9 start a page (5 -> positions 5..7), 8 fills one, 3 does not start
    assert fresh_tail_slots(lens, None, 4, loc).tolist() == [101, 102, 103, 103, 104, 105]
    assert fresh_tail_slots(np.array([6, 7]), None, 4, loc) is None
    # a chunk of 6 ending at 6 (positions 0..5: its last page starts at 4, written): 6..7; a chunk of 2 ending at
    # 10 (positions 8, 9) likewise: 10..11; a decode ending at 7 did not start its page
    slots = fresh_tail_slots(np.array([6, 10, 7]), np.array([6, 2, 1]), 4, loc)
    assert slots.tolist() == [106, 107, 108, 109]


@pytest.mark.parametrize("backend", [CpuAttnBackend, TorchAttnBackend])
def test_a_padded_verify_step_clears_the_real_tails(backend):
    """A verify step padded to rows of `width` (executor/bucketed_steps.py) writes each row's padding positions
    to the dummy page: the page tails to clear are those after each row's real tokens, the same slots as the
    step unpadded (not the dummy page's), in either backend's metadata."""
    pool = KVPool(1, NUM_PAGES * PAGE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), PAGE)
    width, prefixes, fed = 3, [4, 9, 0], [1, 3, 0]  # a row without drafts, a full row, a padding row
    # the real tokens' slots: row 0 starts page 26 at position 4; row 1 feeds positions 9-11 (page 10's slots 41-43)
    real_slots = {0: [104], 1: [41, 42, 43]}
    padded_loc = torch.tensor([104, 0, 0, 41, 42, 43, 0, 0, 0])  # [rows * width], padding on the dummy page
    padded = ForwardBatch.build(
        input_ids=torch.zeros(9, dtype=torch.int64), positions=torch.zeros(3, 9, dtype=torch.int64),
        req_pool_indices=torch.tensor([0, 1, 4]), extend_prefix_lens=prefixes, extend_seq_lens=[width] * 3,
        out_cache_loc=padded_loc, logits_indices=torch.arange(9), to_device=lambda t: t,
        num_drafts=[width - 1] * 3, real_fed_lens=fed)
    unpadded = fresh_tail_slots(np.asarray([4 + 1, 9 + 3]), np.asarray([1, 3]), PAGE,
                                torch.tensor(real_slots[0] + real_slots[1]))
    assert step_fresh_tails(padded, PAGE).tolist() == unpadded.tolist() == [105, 106, 107]
    backend(pool, ReqToTokenPool(5, 64, torch.device("cpu"))).prepare(padded)
    assert padded.attn_metadata.fresh_tails.tolist() == [105, 106, 107]


@pytest.mark.parametrize("backend", ["cpu", "cpu-paged", "torch"])
def test_a_padded_verify_row_reads_no_stale_page_past_its_real_tokens(backend):
    """A padded verify row whose padding runs into a page its real tokens do not reach: that page-table entry is
    stale (here a NaN page), and the real positions must not read it (past the real last page, the first one).
    Row 0 (7 tokens) feeds position 7, its page's last, padded to width 3 (padding at 8, 9: page 2, never
    taken); row 1 (2 tokens) verifies 2 drafts (positions 2-4). Equal to the step unpadded on a clean pool."""
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gen = torch.Generator().manual_seed(5)
    prefill, verify = [[torch.randn(n, h * HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
                       for n in (9, 4)]  # q, k, v of the prefill step and of the verify step's real tokens
    real_rows = torch.tensor([0, 3, 4, 5])  # the padded verify step's real tokens

    def verify_output(seqs: Sequences, padded: bool) -> torch.Tensor:
        fb = seqs.step({0: 7, 1: 2})
        seqs.backend.prepare(fb)
        seqs.backend.forward(*prefill, layer, fb)
        fb = seqs.step({0: 1, 1: 3}, {1: 2})
        if not padded:
            seqs.backend.prepare(fb)
            return seqs.backend.forward(*verify, layer, fb)
        loc = fb.out_cache_loc.tolist()
        fb = ForwardBatch.build(
            input_ids=torch.zeros(6, dtype=torch.int64), positions=torch.zeros(3, 6, dtype=torch.int64),
            req_pool_indices=fb.req_pool_indices, extend_prefix_lens=[7, 2], extend_seq_lens=[3, 3],
            out_cache_loc=torch.tensor(loc[:1] + [0, 0] + loc[1:]), logits_indices=torch.arange(6),
            to_device=lambda t: t, num_drafts=[2, 2], real_fed_lens=[1, 3], attn_backend=seqs.backend)
        seqs.backend.prepare(fb)
        spread = [x.new_zeros(6, x.shape[1]).index_copy_(0, real_rows, x) for x in verify]  # padding: zeros
        return seqs.backend.forward(*spread, layer, fb)[real_rows]

    got = verify_output(Sequences(torch.float32, backend_class(backend), poisoned=True), padded=True)
    expected = verify_output(Sequences(torch.float32, TorchAttnBackend, poisoned=False), padded=False)
    assert got.isfinite().all(), "a real position read the stale page past its real tokens"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
