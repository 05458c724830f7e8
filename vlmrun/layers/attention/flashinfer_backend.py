"""The CUDA full-attention backend: FlashInfer's paged-KV kernels over vlmrun's KV pool.

The KV pool's per-layer buffers [num_slots, kv_heads, head_dim] are, viewed as
[num_pages, page_size, kv_heads, head_dim], FlashInfer's "NHD" paged layout as they are: no copy.
Each step is planned once (`prepare`) and run per layer (`forward`):
  - extend (prefill chunks, with or without a cached prefix, mixed with decodes): ragged queries
    over the paged KV with `BatchPrefillWithPagedKVCacheWrapper`, causal, bottom-right aligned, on
    FlashInfer's FA2 kernels on every GPU (`PREFILL_BACKEND`);
  - decode: `BatchDecodeWithPagedKVCacheWrapper`, with tensor cores for GQA groups of 4 or more;
  - verify (speculative decoding: every sequence feeds its last token and its drafts, nothing else):
    the decode wrapper too, one decode row per fed position over the sequence's keys up to it
    (`verify_positions`), so each position attends exactly as plain decode of its token would, and
    the step has a decode's shape for its CUDA graph.
`build_paged_kv_index` turns a batch into FlashInfer's CSR view of the cache (indptrs, page ids,
last-page lengths) from host lengths plus one gather on the device: no device->host sync. It is
plain torch, unit-tested on the CPU against the torch backend's view of the same batch.
Decode CUDA graphs get a wrapper per batch size (`graph_metadata`; for a verify step, its rows x
(1 + k) positions), re-planned before each replay
(`prepare_graph`). Every wrapper shares one float workspace (zeroed, as FlashInfer requires) and one
int workspace, and the graphs' wrappers share one set of static index buffers sized for the largest
batch: a step plans and runs one wrapper, and only one graph replays at a time. The cache plan
reserves these bytes (`vlmrun.cache.plan.flashinfer_reserve_bytes`).
A float8 pool (`kv_cache_dtype="fp8"`): the plans name the pool's float8 dtype as `kv_data_type` (the
queries stay in the model's dtype) and each layer's run passes its `k_scale` / `v_scale` (FlashInfer folds
them into the softmax scale and the output). Not yet run on a GPU (docs/kv_cache_dtype.md).

`flashinfer_refusal` names what FlashInfer cannot run (float32; head dims its kernels lack on the
device): the backend refuses those with `BackendUnavailable` before any kernel is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, pages_needed
from vlmrun.cache.plan import FLASHINFER_FLOAT_WORKSPACE_BYTES, FLASHINFER_INT_WORKSPACE_BYTES
from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload
from vlmrun.layers.attention.base import Attention, AttentionBackend
from vlmrun.layers.attention.kernels import BackendUnavailable, import_flashinfer

TENSOR_CORE_MIN_GROUP = 4  # decode on tensor cores from this many query heads per KV head
HALF_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's JIT maps no other activation dtype to a kernel
# FA2 on Hopper too ("auto" would take FA3 there): the tensor-core decode runs FlashInfer's FA2 prefill
# module, so prefill shares it and a head_dim compiles one prefill module, not two. On the first H100
# run (2026-11-28) FlashInfer's JIT did not finish the head_dim 128 + 256 modules (FA2 and FA3) in
# 200 s. FA3 is for later, once a GPU run measures what it gains.
PREFILL_BACKEND = "fa2"
FA2_MIN_HEAD_DIM = 64  # FA2's prefill needs head_dim / 16 >= 4 MMA tiles (prefill.cuh, KernelTraits::IsInvalid)
FA2_HEAD_DIM_STEP = 16  # ... and a whole number of 16-wide tiles


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


def verify_positions(fb: ForwardBatch) -> Optional[tuple[torch.Tensor, list[int]]]:
    """A verify step (`fb.num_drafts_cpu`; every sequence feeds its last token and its drafts) as one
    decode row per fed position: (page-table row of each [num_tokens] on the device, keys each attends
    to: its sequence up to and including itself). None for any other step."""
    drafts = fb.num_drafts_cpu
    if drafts is None or any(n != 1 + d for n, d in zip(fb.extend_seq_lens_cpu, drafts)):
        return None
    lens = fb.extend_seq_lens_cpu
    rows = torch.repeat_interleave(fb.req_pool_indices, upload(torch.tensor(lens), fb.req_pool_indices.device),
                                   output_size=sum(lens))
    return rows, [p + j + 1 for p, n in zip(fb.extend_prefix_lens_cpu, lens) for j in range(n)]


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def flashinfer_refusal(head_dim: int, dtype: torch.dtype) -> Optional[str]:
    """Why FlashInfer's FA2 kernels cannot run attention of `head_dim` in `dtype`, or None when they can."""
    if dtype not in HALF_DTYPES:
        return f"FlashInfer runs float16 and bfloat16 only, not {dtype} (its JIT has no entry for it)"
    if head_dim < FA2_MIN_HEAD_DIM or head_dim % FA2_HEAD_DIM_STEP:
        return (f"FlashInfer's prefill (FA2) runs head_dim a multiple of {FA2_HEAD_DIM_STEP} from "
                f"{FA2_MIN_HEAD_DIM}, not {head_dim}")
    return None


@dataclass
class DecodeGraphState:
    """A decode wrapper bound to the shared static index buffers, for one captured batch size."""

    wrapper: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)
    batch_size: int


@dataclass
class GraphIndexBuffers:
    """The static CSR buffers every decode graph reads, sized for the largest batch; a graph of
    batch b reads their first b (+ 1) entries."""

    kv_indptr: torch.Tensor  # [max_batch + 1] int32
    kv_indices: torch.Tensor  # [max_batch * max_pages_per_seq] int32
    kv_last_page_len: torch.Tensor  # [max_batch] int32

    @classmethod
    def allocate(cls, max_batch: int, max_pages_per_seq: int, device: torch.device) -> "GraphIndexBuffers":
        ints = dict(dtype=torch.int32, device=device)
        return cls(torch.zeros(max_batch + 1, **ints), torch.zeros(max_batch * max_pages_per_seq, **ints),
                   torch.zeros(max_batch, **ints))


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, num_q_heads: int, scaling: float,
                 device: torch.device):
        self.flashinfer = import_flashinfer(device)
        refusal = flashinfer_refusal(kv_pool.head_dim, kv_pool.compute_dtype)
        if refusal:
            raise BackendUnavailable(f"attention_backend='flashinfer': {refusal} (use 'auto' or 'torch')")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.max_pages_per_seq = pages_needed(self.req_to_token.shape[1], kv_pool.page_size)
        self.num_q_heads = num_q_heads
        self.scaling = scaling
        self.device = device
        self.use_tensor_cores = num_q_heads // kv_pool.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        # zeroed: FlashInfer's float workspace "must be initialized to 0 for its first use" (its wrappers' docs)
        self.workspace = torch.zeros(FLASHINFER_FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_workspace = torch.zeros(FLASHINFER_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.graph_buffers: Optional[GraphIndexBuffers] = None  # allocated at the first graph_metadata
        self.prefill = self._shared(self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", backend=PREFILL_BACKEND))
        self.decode = self._shared(self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores))

    def prepare(self, fb: ForwardBatch) -> None:
        index = self._index(fb)
        if fb.num_tokens == index.kv_last_page_len.shape[0]:  # one query a row: a decode, or a verify step
            self._plan_decode(self.decode, index)
            fb.attn_metadata = self.decode
            return
        pool = self.kv_pool
        self.prefill.plan(index.qo_indptr, index.kv_indptr, index.kv_indices, index.kv_last_page_len,
                          num_qo_heads=self.num_q_heads, num_kv_heads=pool.num_kv_heads, head_dim_qk=pool.head_dim,
                          page_size=pool.page_size, causal=True, sm_scale=self.scaling,
                          q_data_type=pool.compute_dtype, kv_data_type=pool.dtype)
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
        wrapper: Any = fb.attn_metadata  # the step's prefill or decode wrapper (prepare / graph replay)
        scales = {} if not pool.quantized else dict(k_scale=pool.k_scales[layer.layer_id],
                                                    v_scale=pool.v_scales[layer.layer_id])
        out = wrapper.run(q.view(num_tokens, layer.num_heads, layer.head_dim).to(pool.compute_dtype), paged, **scales)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim).to(q.dtype)  # [num_tokens, heads * head_dim]

    # ------------------------------------------------------------------ decode CUDA graphs

    def graph_metadata(self, batch_size: int) -> DecodeGraphState:
        """A decode wrapper over the first `batch_size` rows of the shared static index buffers, which
        keep their addresses across replays."""
        if self.graph_buffers is None:  # every page-table row (the dummy row included), or a verify step's positions
            max_batch = max(self.req_to_token.shape[0], batch_size)
            self.graph_buffers = GraphIndexBuffers.allocate(max_batch, self.max_pages_per_seq, self.device)
        buffers = self.graph_buffers
        if batch_size > buffers.kv_last_page_len.shape[0]:
            raise ValueError(f"a decode graph of {batch_size} rows; the page table has {buffers.kv_last_page_len.shape[0]}")
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=buffers.kv_indptr[:batch_size + 1],
            paged_kv_indices_buffer=buffers.kv_indices[:batch_size * self.max_pages_per_seq],
            paged_kv_last_page_len_buffer=buffers.kv_last_page_len[:batch_size])
        return DecodeGraphState(self._shared(wrapper), batch_size)

    def prepare_graph(self, state: DecodeGraphState, fb: ForwardBatch) -> None:
        """Plan `fb` (a padded decode batch of `state.batch_size`) into the state's static buffers."""
        self._plan_decode(state.wrapper, self._index(fb))
        fb.attn_metadata = state.wrapper

    # ------------------------------------------------------------------ helpers

    def _index(self, fb: ForwardBatch) -> PagedKVIndex:
        """The batch's CSR index; a verify step's has one decode row per fed position."""
        positions = verify_positions(fb)
        if positions is not None:
            rows, seq_lens = positions
            return build_paged_kv_index(self.req_to_token, rows, seq_lens, [1] * len(seq_lens), self.kv_pool.page_size)
        return build_paged_kv_index(self.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu,
                                    fb.extend_seq_lens_cpu, self.kv_pool.page_size)

    def _shared(self, wrapper: Any) -> Any:
        """`wrapper` on the backend's one float and one int workspace (FlashInfer gives each wrapper its own
        8 MiB int workspace otherwise; that one is freed here, its pinned host copy stays per wrapper)."""
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        return wrapper

    def _plan_decode(self, wrapper: Any, index: PagedKVIndex) -> None:
        pool = self.kv_pool
        wrapper.plan(index.kv_indptr, index.kv_indices, index.kv_last_page_len, num_qo_heads=self.num_q_heads,
                     num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, page_size=pool.page_size,
                     sm_scale=self.scaling, q_data_type=pool.compute_dtype, kv_data_type=pool.dtype)
