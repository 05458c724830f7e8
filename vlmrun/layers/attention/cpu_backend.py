"""The CPU attention backend: the torch reference's results, laid out for the CPU's kernels.

The reference (torch_backend.py) pads the whole batch to [batch, max_extend] queries and gathers
every sequence's pages into [batch, max_seq] keys with advanced indexing, then runs one masked
SDPA. On the CPU both halves of that are slow: advanced indexing copies a page at a time through
ATen's generic index kernel, and the masked flash kernel is slowest in bfloat16 with one query per
row. This backend splits the batch by what each sequence does this step:

- Decode rows (one new token each) run together. Each layer copies their pages with
  `index_select` (whole pages as rows: a memcpy each), and the query heads that share a
  KV head ride as that head's query rows (q [decodes, kv_heads, group, head_dim]), so one SDPA call
  over [decodes, kv_heads] needs no GQA expansion and a mask of [decodes, 1, 1, max_seq].
- Speculative-decoding verify chunks (`fb.num_drafts_cpu`: a sequence's last token and its drafts)
  run the same way, grouped by width (tokens fed): each sequence's pages are gathered once and its
  positions, times the query heads of a KV head, are that head's query rows
  (q [seqs, kv_heads, width * group, head_dim]); the mask lets position j see the keys before
  prefix + j + 1 (the step wrote the chunk's k/v before attending), what plain decode of that token sees.
- Prefill rows (a chunk of several tokens) run one sequence at a time on their own lengths. A
  chunk with no cached prefix attends to its own k/v rows of this step (no gather, no mask:
  `is_causal`); a chunk over a cached prefix gathers its pages and uses a bottom-right causal mask.

Decode and verify rows gather pages up to the group's longest sequence: a sequence's pages past its last
are its first one again and its last page's tail holds zeros or its own values (the step that writes a
page's first position zeroes the rest of it in the pool: stale_keys.py), so the mask hides only values of
its own or zeros (a prefill chunk reads its own positions only). The metadata is made once per step, on
the host from the host lengths (numpy) where it can be: the masks, the page-table columns to read.

With the paged decode kernel (paged_decode.py: C, built on first use where a C compiler is there), decode and
verify groups of a float32 or bfloat16 pool gather nothing: the kernel reads each sequence's pages in place, with
the same `sees` per query position (no mask is made); without it they gather as above.

It reads and writes the same KV pool as the reference and is tested against it (tests/test_cpu_backend.py).
A float8 pool (`kv_cache_dtype="fp8"`) is read through `dequantize` (stored values times the layer's scale)
as the pages are gathered; a prefill chunk then reads its own k/v back from the pool too, as stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, cast

import numpy as np
import torch
import torch.nn.functional as F

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, dequantize
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, AttentionBackend
from vlmrun.layers.attention.paged_decode import KV_DTYPES, PagedDecodeKernel
from vlmrun.layers.attention.stale_keys import real_lens, step_fresh_tails
from vlmrun.host_to_device import upload


@dataclass
class DecodeGroup:
    """Sequences that each feed `width` tokens this step (plain decodes: 1; verify chunks: 1 + drafts),
    attended together: each sequence's pages gathered once, its positions as query rows of one SDPA."""

    width: int
    # [seqs * width] token row of each fed position, sequence by sequence; None when the group is the whole step
    rows: Optional[torch.Tensor]
    page_ids: torch.Tensor  # [seqs * max_pages] KV page of each page-sized run of key positions (past the
    # sequence's last page: its first page, stale_keys.py)
    max_seq: int  # key positions of each sequence's pages read (max_pages * page_size)
    sees: torch.Tensor  # [seqs, width] int64 (host): position j sees the sequence's first sees[j] keys (prefix + j + 1)
    # [seqs, width, max_seq] in the compute dtype: 0 for the keys position j sees, -inf for the others (the
    # gathering path's SDPA mask; None under the paged decode kernel). SDPA turns a bool mask into this very
    # one in every call; made once, each layer skips that.
    bias: Optional[torch.Tensor]
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # query heads per KV head -> SDPA mask

    @property
    def visible(self) -> torch.Tensor:
        """[seqs, width, max_seq] bool, True for the keys position j sees."""
        if self.bias is not None:
            return self.bias == 0
        return torch.arange(self.max_seq)[None, None] < self.sees[..., None]

    def mask(self, group: int) -> torch.Tensor:
        """[seqs, 1, width * group, max_seq]: the additive mask of query rows laid out position-major, heads minor."""
        if self.bias is None:
            raise RuntimeError("a paged decode group has no SDPA mask (the kernel reads `sees`)")
        if self.width == 1:
            return self.bias[:, None]  # [seqs, 1, 1, max_seq]: broadcast over the group's heads
        if group not in self.masks:
            self.masks[group] = self.bias.repeat_interleave(group, dim=1)[:, None]
        return self.masks[group]


@dataclass
class PrefillChunk:
    """One sequence feeding several tokens: rows [start, start + length) of the step."""

    start: int
    length: int
    seq_len: int  # keys it attends to: cached prefix + this chunk
    page_ids: torch.Tensor  # [pages] KV pages of the sequence
    mask: Optional[torch.Tensor]  # [length, seq_len] bool bottom-right causal mask; None without a cached prefix


@dataclass
class CpuAttnMetadata:
    decodes: list[DecodeGroup]  # one per width
    prefills: list[PrefillChunk]
    # [m] KV slots past a sequence's length in a page this step writes first: zeroed in the pool after each
    # layer's write (stale_keys.step_fresh_tails); None: none this step
    fresh_tails: Optional[torch.Tensor] = None


class CpuAttnBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 paged_decode: Optional[PagedDecodeKernel] = None):
        self.kv_pool = kv_pool
        # decode and verify groups read their pages in place through it (a pool dtype it reads); None: they gather
        self.paged_decode = paged_decode if kv_pool.dtype in KV_DTYPES else None
        self.req_to_token = req_to_token_pool.req_to_token
        self.req_to_token_host = self.req_to_token.numpy()  # the same memory: the decode groups' page ids read it
        self.page_size = kv_pool.page_size
        self._bias_windows = np.zeros((1, 0), np.float32)  # `_bias_rows`' windows, `_bias_width` wide
        self._bias_width = 0

    def prepare(self, fb: ForwardBatch) -> None:
        extend_lens = fb.extend_seq_lens_cpu
        all_lens = np.fromiter(fb.seq_lens_cpu, dtype=np.int64, count=fb.batch_size)  # [batch]
        fresh = step_fresh_tails(fb, self.page_size, all_lens)
        if fb.num_drafts_cpu is None and fb.num_tokens == fb.batch_size:  # every sequence decodes one token
            fb.attn_metadata = CpuAttnMetadata([self._decode_group(fb, None, 1, all_lens, None)], [], fresh)
            return
        drafts = fb.num_drafts_cpu or [0] * fb.batch_size
        starts = [0]
        for n in extend_lens:
            starts.append(starts[-1] + n)
        by_width: dict[int, list[int]] = {}  # tokens fed -> sequences that decode or verify
        prefill_idx = []
        for i, n in enumerate(extend_lens):
            if n == 1 or drafts[i]:
                by_width.setdefault(n, []).append(i)
            else:
                prefill_idx.append(i)
        whole_step = not prefill_idx and len(by_width) == 1
        real = real_lens(fb)  # a padded verify step's real lengths: page-table entries past them are stale
        page_lens = all_lens if real is None else real  # [batch] positions whose entries are the sequence's own
        decodes = [self._decode_group(fb, None if whole_step else idx, width, all_lens[idx],
                                      None if whole_step else starts, page_lens[idx]) for width, idx in by_width.items()]
        rows = fb.req_pool_indices.tolist() if prefill_idx else []  # host values (this backend is the CPU's)
        prefills = [self._prefill_chunk(rows[i], starts[i], extend_lens[i], fb.extend_prefix_lens_cpu[i],
                                        fb.seq_lens_cpu[i]) for i in prefill_idx]
        fb.attn_metadata = CpuAttnMetadata(decodes, prefills, fresh)

    def _decode_group(self, fb: ForwardBatch, idx: Optional[list[int]], width: int, lens: np.ndarray,
                      starts: Optional[list[int]], page_lens: Optional[np.ndarray] = None) -> DecodeGroup:
        """Sequences `idx` (None: every sequence of the step), each feeding `width` tokens, of lengths
        `lens` [seqs] (host); `starts`: each sequence's first token row in the step (None with `idx`);
        `page_lens` [seqs]: the positions whose pages are read from the page table (default `lens`; a padded
        verify step's real lengths: past them a row reads its first page again, as past its last page)."""
        page_size, device = self.page_size, fb.seq_lens.device
        max_seq = -(-int(lens.max()) // page_size) * page_size
        req_rows = fb.req_pool_indices.numpy()  # [batch] (host: this backend's tensors are the CPU's)
        req_rows = req_rows if idx is None else req_rows[idx]  # [seqs]
        page_starts = np.arange(0, max_seq, page_size)  # [max_pages] first position of each page
        # [seqs, max_pages] the page-table column each page is read from: its own, or past the sequence's last
        # page its first
        columns = np.where(page_starts < (lens if page_lens is None else page_lens)[:, None], page_starts, 0)
        page_ids = self.req_to_token_host[req_rows[:, None], columns] // page_size  # [seqs, max_pages] (a copy)
        if width == 1:  # a plain decode sees its whole length (>= 1: it holds the token it feeds)
            sees = lens[:, None]  # [seqs, 1]
        else:  # position j sees the keys before prefix + j + 1 (the first fed position: at least 1)
            sees = np.maximum(lens - (width - 1), 1)[:, None] + np.arange(width)
        bias = None
        if self.paged_decode is None:  # the gathering path's SDPA mask
            bias = self._bias_rows(max_seq)[max_seq - sees]  # [seqs, width, max_seq] (fancy indexing: a copy)
            bias = upload(torch.from_numpy(bias), device).to(self.kv_pool.compute_dtype)
        token_rows = None if idx is None else upload(torch.tensor([starts[i] + j for i in idx for j in range(width)]),
                                                     device)
        return DecodeGroup(width, token_rows, upload(torch.from_numpy(page_ids.reshape(-1)), device), max_seq,
                           torch.from_numpy(np.ascontiguousarray(sees, dtype=np.int64)), bias)

    def _bias_rows(self, max_seq: int) -> np.ndarray:
        """[max_seq + 1, max_seq] float32 view: row max_seq - n is 0 for the first n keys, -inf for the rest. The
        windows of one line of `widest` zeros then `widest` -inf, kept for the widest max_seq seen (remade only
        when a step needs a wider one), cut to this step's: no copy until the step's rows are indexed."""
        if max_seq > self._bias_width:
            line = np.concatenate([np.zeros(max_seq, np.float32), np.full(max_seq, -np.inf, np.float32)])
            self._bias_windows = np.lib.stride_tricks.sliding_window_view(line, max_seq)
            self._bias_width = max_seq
        widest = self._bias_width  # window i of the widest: zeros for widest - i keys, so rows start at widest - max_seq
        return self._bias_windows[widest - max_seq:, :max_seq]

    def _prefill_chunk(self, row: int, start: int, length: int, prefix: int, seq_len: int) -> PrefillChunk:
        pages = -(-seq_len // self.page_size)
        page_ids = self.req_to_token[row, :pages * self.page_size:self.page_size] // self.page_size
        if prefix == 0:
            return PrefillChunk(start, length, seq_len, page_ids, None)
        k_pos = torch.arange(seq_len, device=page_ids.device)
        q_pos = torch.arange(length, device=page_ids.device) + prefix
        return PrefillChunk(start, length, seq_len, page_ids, k_pos[None, :] <= q_pos[:, None])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        md = cast(CpuAttnMetadata, fb.attn_metadata)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        self.kv_pool.write(layer.layer_id, fb.out_cache_loc, k, v)
        if md.fresh_tails is not None:  # the rest of each page a sequence starts this step (stale_keys.py)
            self.kv_pool.clear(layer.layer_id, md.fresh_tails)
        pool, i = self.kv_pool, layer.layer_id
        k_pool, v_pool = (pool.k_buffers[i], pool.k_scales[i]), (pool.v_buffers[i], pool.v_scales[i])  # (buffer, scale)
        if len(md.decodes) == 1 and md.decodes[0].rows is None:  # every sequence feeds as many tokens
            return self._decode(q, k_pool, v_pool, layer, md.decodes[0]).view(num_tokens, -1)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        for group in md.decodes:
            out.index_copy_(0, group.rows, self._decode(q.index_select(0, group.rows), k_pool, v_pool, layer, group))
        for chunk in md.prefills:
            out[chunk.start:chunk.start + chunk.length] = self._prefill(q, k, v, k_pool, v_pool, layer, chunk)
        return out.view(num_tokens, -1)

    def _decode(self, q: torch.Tensor, k_pool: tuple[torch.Tensor, float], v_pool: tuple[torch.Tensor, float],
                layer: Attention, group: DecodeGroup) -> torch.Tensor:
        # q: [seqs * width, num_heads, head_dim] -> [seqs * width, num_heads, head_dim]
        n, width, group_size = q.shape[0] // group.width, group.width, layer.num_heads // layer.num_kv_heads
        if self.paged_decode is not None:  # the pages read in place
            return self.paged_decode.attend(q, k_pool[0], v_pool[0], group.page_ids.view(n, -1), group.sees,
                                            self.page_size, layer.scaling)
        k_all = self._gather(k_pool, group.page_ids, n, q.dtype)  # [seqs, kv_heads, max_seq, head_dim]
        v_all = self._gather(v_pool, group.page_ids, n, q.dtype)
        q_rows = q.view(n, width, layer.num_kv_heads, group_size, layer.head_dim).transpose(1, 2)
        q_rows = q_rows.reshape(n, layer.num_kv_heads, width * group_size, layer.head_dim)  # position-major rows
        out = F.scaled_dot_product_attention(q_rows, k_all, v_all, attn_mask=group.mask(group_size),
                                             scale=layer.scaling)  # [seqs, kv_heads, width * group, head_dim]
        out = out.view(n, layer.num_kv_heads, width, group_size, layer.head_dim).transpose(1, 2)
        return out.reshape(n * width, layer.num_heads, layer.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: tuple[torch.Tensor, float],
                 v_pool: tuple[torch.Tensor, float], layer: Attention, chunk: PrefillChunk) -> torch.Tensor:
        rows = slice(chunk.start, chunk.start + chunk.length)
        q_c = q[rows].transpose(0, 1)[None]  # [1, heads, length, head_dim]
        if chunk.mask is None and k.dtype == k_pool[0].dtype:  # no cached prefix: its own rows of this step
            k_c, v_c = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]  # [1, kv_heads, length, head_dim]
        else:
            k_c = self._gather(k_pool, chunk.page_ids, 1, q.dtype)[:, :, :chunk.seq_len]
            v_c = self._gather(v_pool, chunk.page_ids, 1, q.dtype)[:, :, :chunk.seq_len]
        causal = chunk.mask is None  # keys = the chunk's own tokens: top-left causal is the right one
        out = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=chunk.mask, is_causal=causal, scale=layer.scaling,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out[0].transpose(0, 1)  # [length, heads, head_dim]

    def _gather(self, pool: tuple[torch.Tensor, float], page_ids: torch.Tensor, batch: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Whole pages by id of `pool` (a layer's buffer and scale) -> [batch, kv_heads, pages_per_row *
        page_size, head_dim] in `dtype` (a strided view)."""
        buffer, scale = pool
        pages = buffer.view(-1, self.page_size * buffer.shape[1] * buffer.shape[2])  # one row per page
        rows = dequantize(torch.index_select(pages, 0, page_ids), scale, dtype)  # [batch * pages_per_row, page * kv_heads * head_dim]
        return rows.view(batch, -1, *buffer.shape[1:]).transpose(1, 2)
