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
- Prefill rows (a chunk of several tokens) run one sequence at a time on their own lengths. A
  chunk with no cached prefix attends to its own k/v rows of this step (no gather, no mask:
  `is_causal`); a chunk over a cached prefix gathers its pages and uses a bottom-right causal mask.
- A speculative-decoding verify chunk (`fb.num_drafts_cpu`: its last token and drafts) joins the
  decode rows, one row per position, each attending to its sequence up to itself (the step wrote
  the chunk's k/v before attending), as plain decode would attend for that token.

It reads and writes the same KV pool as the reference and is tested against it (tests/test_cpu_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, AttentionBackend


@dataclass
class DecodeGroup:
    """The step's decode rows, attended together."""

    rows: Optional[torch.Tensor]  # [num_decode] token row of each decode; None when every row decodes
    page_ids: torch.Tensor  # [num_decode * max_pages] KV page of each page-sized run of key positions
    mask: torch.Tensor  # [num_decode, 1, 1, max_seq] bool, True for a sequence's cached keys


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
    decode: Optional[DecodeGroup]
    prefills: list[PrefillChunk]


class CpuAttnBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = kv_pool.page_size

    def prepare(self, fb: ForwardBatch) -> None:
        extend_lens = fb.extend_seq_lens_cpu
        verifies = fb.num_drafts_cpu or [0] * fb.batch_size
        decode_idx = [i for i, n in enumerate(extend_lens) if n == 1 or verifies[i]]
        starts = [0]
        for n in extend_lens:
            starts.append(starts[-1] + n)
        decode = (None if not decode_idx else self._decode_group(fb, decode_idx, starts) if not any(verifies)
                  else self._verify_group(fb, decode_idx, starts))
        prefill_idx = [i for i, n in enumerate(extend_lens) if n > 1 and not verifies[i]]
        rows = fb.req_pool_indices.tolist() if prefill_idx else []  # host values (this backend is the CPU's)
        prefills = [self._prefill_chunk(rows[i], starts[i], extend_lens[i], fb.extend_prefix_lens_cpu[i],
                                        fb.seq_lens_cpu[i]) for i in prefill_idx]
        fb.attn_metadata = CpuAttnMetadata(decode, prefills)

    def _decode_group(self, fb: ForwardBatch, idx: list[int], starts: list[int]) -> DecodeGroup:
        seq_lens = [fb.seq_lens_cpu[i] for i in idx]
        max_pages = -(-max(seq_lens) // self.page_size)
        max_seq = max_pages * self.page_size
        all_decode = len(idx) == fb.batch_size
        sel = None if all_decode else torch.tensor(idx, device=fb.seq_lens.device)
        req_rows = fb.req_pool_indices if sel is None else fb.req_pool_indices[sel]
        page_ids = (self.req_to_token[req_rows, :max_seq:self.page_size] // self.page_size).flatten()
        lens = fb.seq_lens if sel is None else fb.seq_lens[sel]
        mask = torch.arange(max_seq, device=lens.device)[None, :] < lens.clamp(min=1)[:, None]  # [num_decode, max_seq]
        token_rows = None if all_decode else torch.tensor([starts[i] for i in idx], device=fb.seq_lens.device)
        return DecodeGroup(token_rows, page_ids, mask[:, None, None, :])

    def _verify_group(self, fb: ForwardBatch, idx: list[int], starts: list[int]) -> DecodeGroup:
        """Decode rows for sequences `idx`, one per fed token (a verify chunk's positions, a decode's one)."""
        req_rows = fb.req_pool_indices.tolist()  # host values (this backend is the CPU's)
        token_rows, rows, seq_lens = [], [], []
        for i in idx:
            for j in range(fb.extend_seq_lens_cpu[i]):
                token_rows.append(starts[i] + j)
                rows.append(req_rows[i])
                seq_lens.append(fb.extend_prefix_lens_cpu[i] + j + 1)
        max_seq = -(-max(seq_lens) // self.page_size) * self.page_size
        device = fb.seq_lens.device
        page_ids = (self.req_to_token[torch.tensor(rows, device=device), :max_seq:self.page_size] // self.page_size)
        lens = torch.tensor(seq_lens, device=device)
        mask = torch.arange(max_seq, device=device)[None, :] < lens[:, None]  # [rows, max_seq]
        every_row = len(token_rows) == starts[-1]
        return DecodeGroup(None if every_row else torch.tensor(token_rows, device=device), page_ids.flatten(),
                           mask[:, None, None, :])

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
        k_pool, v_pool = self.kv_pool.k_buffers[layer.layer_id], self.kv_pool.v_buffers[layer.layer_id]
        if md.decode is not None and md.decode.rows is None:  # a pure decode step
            return self._decode(q, k_pool, v_pool, layer, md.decode).view(num_tokens, -1)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        if md.decode is not None:
            out.index_copy_(0, md.decode.rows, self._decode(q.index_select(0, md.decode.rows), k_pool, v_pool,
                                                             layer, md.decode))
        for chunk in md.prefills:
            out[chunk.start:chunk.start + chunk.length] = self._prefill(q, k, v, k_pool, v_pool, layer, chunk)
        return out.view(num_tokens, -1)

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: Attention,
                group: DecodeGroup) -> torch.Tensor:
        # q: [num_decode, num_heads, head_dim] -> [num_decode, num_heads, head_dim]
        n = q.shape[0]
        k_all = self._gather(k_pool, group.page_ids, n, q.dtype)  # [num_decode, kv_heads, max_seq, head_dim]
        v_all = self._gather(v_pool, group.page_ids, n, q.dtype)
        q_grouped = q.view(n, layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim)
        out = F.scaled_dot_product_attention(q_grouped, k_all, v_all, attn_mask=group.mask, scale=layer.scaling)
        return out.view(n, layer.num_heads, layer.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, layer: Attention, chunk: PrefillChunk) -> torch.Tensor:
        rows = slice(chunk.start, chunk.start + chunk.length)
        q_c = q[rows].transpose(0, 1)[None]  # [1, heads, length, head_dim]
        if chunk.mask is None and k.dtype == k_pool.dtype:  # no cached prefix: its own rows of this step
            k_c, v_c = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]  # [1, kv_heads, length, head_dim]
        else:
            k_c = self._gather(k_pool, chunk.page_ids, 1, q.dtype)[:, :, :chunk.seq_len]
            v_c = self._gather(v_pool, chunk.page_ids, 1, q.dtype)[:, :, :chunk.seq_len]
        causal = chunk.mask is None  # keys = the chunk's own tokens: top-left causal is the right one
        out = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=chunk.mask, is_causal=causal, scale=layer.scaling,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out[0].transpose(0, 1)  # [length, heads, head_dim]

    def _gather(self, buffer: torch.Tensor, page_ids: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """Whole pages by id -> [batch, kv_heads, pages_per_row * page_size, head_dim] (a strided view)."""
        pages = buffer.view(-1, self.page_size * buffer.shape[1] * buffer.shape[2])  # one row per page
        rows = torch.index_select(pages, 0, page_ids).to(dtype)  # [batch * pages_per_row, page * kv_heads * head_dim]
        return rows.view(batch, -1, *buffer.shape[1:]).transpose(1, 2)
