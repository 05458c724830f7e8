"""The reference attention backend: plain torch, any device.

Every sequence's new queries attend causally to its cached tokens plus the tokens it feeds this
step. The batch is padded to [batch, max_extend] queries and [batch, max_seq] keys gathered from
the KV pool through the request-to-token map (whole pages at a time: a request's tokens fill its pages in order), and
one masked SDPA call covers the whole batch. The gathered positions past a sequence's length are its own
or zeros, so no other request's values meet the mask: past its last page the page table reads its first
page again (`own_pages`), and the step that writes a page's first position zeroes the rest of that page in
the pool after each layer's write (`step_fresh_tails`, `KVPool.clear`: stale_keys.py, as the cpu backend
does). A float8 pool (`kv_cache_dtype="fp8"`) is read through `dequantize`: the gathered values times the
layer's scale, in the queries' dtype.
Every fast backend is tested against this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, dequantize
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.attention.base import Attention, AttentionBackend
from vlmrun.layers.attention.stale_keys import own_lens, own_pages, step_fresh_tails


@dataclass
class TorchAttnMetadata:
    token_rows: torch.Tensor  # [batch, max_extend] row of each padded query in the token stream
    out_rows: torch.Tensor  # [batch * max_extend] row each padded query's output goes to; num_tokens (a dummy) for padding
    page_table: torch.Tensor  # [batch, max_pages] KV page of each page-sized run of key positions
    mask: torch.Tensor  # [batch, 1, max_extend, max_seq] bool, True where a query may attend
    # [m] KV slots past a sequence's length in a page this step writes first: zeroed in the pool after each
    # layer's write (stale_keys.step_fresh_tails); None: none this step
    fresh_tails: Optional[torch.Tensor]


class TorchAttnBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token

    def prepare(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        max_extend = max(fb.extend_seq_lens_cpu)
        max_seq = max(fb.seq_lens_cpu)
        extend_lens = fb.extend_seq_lens.view(-1, 1)  # [batch, 1]
        prefix_lens = fb.extend_prefix_lens.view(-1, 1)
        seq_lens = fb.seq_lens.view(-1, 1)

        q_pos = torch.arange(max_extend, device=device).view(1, -1)  # [1, max_extend]
        valid_queries = q_pos < extend_lens  # [batch, max_extend]
        starts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens  # [batch]
        token_rows = (starts.view(-1, 1) + q_pos).clamp(max=fb.num_tokens - 1)
        out_rows = torch.where(valid_queries, starts.view(-1, 1) + q_pos, fb.num_tokens).flatten()

        page_size = self.kv_pool.page_size
        max_pages = (max_seq + page_size - 1) // page_size
        max_seq = max_pages * page_size  # keys are gathered page by page; the mask hides the tail
        k_pos = torch.arange(max_seq, device=device).view(1, 1, -1)  # [1, 1, max_seq]
        causal = k_pos <= (prefix_lens + q_pos).unsqueeze(-1)  # [batch, max_extend, max_seq]
        mask = causal & (k_pos < seq_lens.unsqueeze(-1))
        mask[:, :, 0] |= ~valid_queries  # padded queries see key 0 so softmax stays finite
        # Entries past a request's last page are stale: they become its first page (hidden by the mask)
        page_table = self.req_to_token[fb.req_pool_indices, :max_seq:page_size] // page_size  # [batch, max_pages]
        page_table = own_pages(page_table, own_lens(fb), page_size)
        fresh = step_fresh_tails(fb, page_size)
        fb.attn_metadata = TorchAttnMetadata(token_rows, out_rows, page_table, mask.unsqueeze(1), fresh)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        md = cast(TorchAttnMetadata, fb.attn_metadata)
        num_tokens = q.shape[0]
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        self.kv_pool.write(layer.layer_id, fb.out_cache_loc, k, v)
        if md.fresh_tails is not None:  # the rest of each page a sequence starts this step (stale_keys.py)
            self.kv_pool.clear(layer.layer_id, md.fresh_tails)

        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        q_pad = q[md.token_rows].transpose(1, 2)  # [batch, heads, max_extend, head_dim]
        pool, i = self.kv_pool, layer.layer_id
        k_all = self._gather(pool.k_buffers[i], pool.k_scales[i], md, q.dtype)  # [batch, kv_heads, max_seq, head_dim]
        v_all = self._gather(pool.v_buffers[i], pool.v_scales[i], md, q.dtype)
        out = F.scaled_dot_product_attention(
            q_pad, k_all, v_all, attn_mask=md.mask, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [batch, heads, max_extend, head_dim]
        # Scatter the real queries back to the token stream by index (a boolean mask would cost a
        # device->host sync in every layer); padded queries land in a dummy row that is dropped.
        rows = out.new_empty(num_tokens + 1, layer.num_heads, layer.head_dim)
        rows.index_copy_(0, md.out_rows, out.transpose(1, 2).flatten(0, 1))
        return rows[:num_tokens].reshape(num_tokens, layer.num_heads * layer.head_dim)

    def _gather(self, buffer: torch.Tensor, scale: float, md: TorchAttnMetadata, dtype: torch.dtype) -> torch.Tensor:
        page_size = self.kv_pool.page_size
        pages = buffer.view(-1, page_size, *buffer.shape[1:])[md.page_table]  # [batch, max_pages, page, kv_heads, head_dim]
        pages = dequantize(pages, scale, dtype)
        return pages.flatten(1, 2).transpose(1, 2)
