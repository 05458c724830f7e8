"""The CUDA full-attention backend: FlashInfer's paged-KV kernels over vlmrun's KV pool.

The KV pool's per-layer buffers [num_slots, kv_heads, head_dim] are, viewed as
[num_pages, page_size, kv_heads, head_dim], FlashInfer's "NHD" paged layout as they are: no copy.
Each step is planned once (`prepare`) and run per layer (`forward`):
  - extend (prefill chunks, with or without a cached prefix, mixed with decodes): ragged queries
    over the paged KV with `BatchPrefillWithPagedKVCacheWrapper`, causal, bottom-right aligned;
  - decode: `BatchDecodeWithPagedKVCacheWrapper`, with tensor cores for GQA groups of 4 or more.
`build_paged_kv_index` turns a batch into FlashInfer's CSR view of the cache (indptrs, page ids,
last-page lengths) from host lengths plus one gather on the device: no device->host sync. It is
plain torch, unit-tested on the CPU against the torch backend's view of the same batch.
Decode CUDA graphs get a wrapper per batch size with static index buffers (`graph_metadata`),
re-planned before each replay (`prepare_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, pages_needed
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import Attention, AttentionBackend
from vlmrun.layers.attention.kernels import import_flashinfer

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-k partial results), shared by the wrappers
TENSOR_CORE_MIN_GROUP = 4  # decode on tensor cores from this many query heads per KV head


@dataclass
class PagedKVIndex:
    """A batch's view of the paged KV cache in FlashInfer's CSR form."""

    qo_indptr: torch.Tensor  # [batch + 1] int32 host: sequence i's queries are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [batch + 1] int32 host: its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [total_pages] int32 on the device: page ids in token order
    kv_last_page_len: torch.Tensor  # [batch] int32 host: tokens in each sequence's last page (1..page_size)


def build_paged_kv_index(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int],
                         extend_lens: list[int], page_size: int) -> PagedKVIndex:
    """The CSR index of a batch: sequence i (page-table row req_pool_indices[i]) holds seq_lens[i]
    tokens after this step and feeds extend_lens[i] of them."""
    num_pages = [pages_needed(n, page_size) for n in seq_lens]
    max_pages = max(num_pages)
    # the first slot of every page of every row, then the pages each sequence really holds
    table = req_to_token[req_pool_indices, : max_pages * page_size : page_size]  # [batch, max_pages]
    counts = torch.tensor(num_pages, dtype=torch.int64)
    kv_indptr = _indptr(num_pages)
    # entry j of sequence i sits at i * max_pages + j in the flattened table (no Python loop per sequence)
    within = torch.arange(int(kv_indptr[-1]), dtype=torch.int64) - torch.repeat_interleave(kv_indptr[:-1].long(), counts)
    flat = torch.repeat_interleave(torch.arange(len(num_pages), dtype=torch.int64) * max_pages, counts) + within
    kv_indices = (table.flatten()[flat.to(table.device)] // page_size).to(torch.int32)
    return PagedKVIndex(
        qo_indptr=_indptr(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, num_pages)],
                                      dtype=torch.int32),
    )


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


@dataclass
class DecodeGraphState:
    """A decode wrapper bound to static index buffers, for one captured batch size."""

    wrapper: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)
    batch_size: int


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, num_q_heads: int, scaling: float,
                 device: torch.device):
        self.flashinfer = import_flashinfer(device)
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.max_pages_per_seq = pages_needed(self.req_to_token.shape[1], kv_pool.page_size)
        self.num_q_heads = num_q_heads
        self.scaling = scaling
        self.device = device
        self.use_tensor_cores = num_q_heads // kv_pool.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                         use_tensor_cores=self.use_tensor_cores)

    def prepare(self, fb: ForwardBatch) -> None:
        index = self._index(fb)
        if fb.mode is ForwardMode.DECODE:
            self._plan_decode(self.decode, index)
            fb.attn_metadata = self.decode
            return
        pool = self.kv_pool
        self.prefill.plan(index.qo_indptr, index.kv_indptr, index.kv_indices, index.kv_last_page_len,
                          self.num_q_heads, pool.num_kv_heads, pool.head_dim, pool.page_size, causal=True,
                          sm_scale=self.scaling, q_data_type=pool.dtype, kv_data_type=pool.dtype)
        fb.attn_metadata = self.prefill

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        if layer.scaling != self.scaling:
            raise ValueError(f"layer {layer.layer_id} scales by {layer.scaling}, the plan by {self.scaling}")
        num_tokens = q.shape[0]
        pool = self.kv_pool
        pool.write(layer.layer_id, fb.out_cache_loc, k.view(num_tokens, pool.num_kv_heads, pool.head_dim),
                   v.view(num_tokens, pool.num_kv_heads, pool.head_dim))
        paged = (pool.k_buffers[layer.layer_id].view(-1, pool.page_size, pool.num_kv_heads, pool.head_dim),
                 pool.v_buffers[layer.layer_id].view(-1, pool.page_size, pool.num_kv_heads, pool.head_dim))
        out = fb.attn_metadata.run(q.view(num_tokens, layer.num_heads, layer.head_dim).to(pool.dtype), paged)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim).to(q.dtype)  # [num_tokens, heads * head_dim]

    # ------------------------------------------------------------------ decode CUDA graphs

    def graph_metadata(self, batch_size: int) -> DecodeGraphState:
        """A decode wrapper whose index buffers keep their addresses across replays of one graph."""
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(batch_size * self.max_pages_per_seq, dtype=torch.int32,
                                                device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device))
        return DecodeGraphState(wrapper, batch_size)

    def prepare_graph(self, state: DecodeGraphState, fb: ForwardBatch) -> None:
        """Plan `fb` (a padded decode batch of `state.batch_size`) into the state's static buffers."""
        self._plan_decode(state.wrapper, self._index(fb))
        fb.attn_metadata = state.wrapper

    # ------------------------------------------------------------------ helpers

    def _index(self, fb: ForwardBatch) -> PagedKVIndex:
        return build_paged_kv_index(self.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu,
                                    fb.extend_seq_lens_cpu, self.kv_pool.page_size)

    def _plan_decode(self, wrapper: Any, index: PagedKVIndex) -> None:
        pool = self.kv_pool
        wrapper.plan(index.kv_indptr, index.kv_indices, index.kv_last_page_len, self.num_q_heads,
                     pool.num_kv_heads, pool.head_dim, pool.page_size, sm_scale=self.scaling,
                     q_data_type=pool.dtype, kv_data_type=pool.dtype)
