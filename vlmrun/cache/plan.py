"""Cache memory: one budget planned into the KV pool and the GDN state pool, and the pools built.

`plan_cache_memory` splits one byte budget between the paged KV cache (full-attention layers) and
the GDN state pool (hybrid models' GDN layers), with optional GDN snapshots for the
prefix cache. `build_caches` sizes the budget (explicit, the CPU default, or a share of free GPU
memory less what a step and the attention kernels' fixed buffers need: `flashinfer_reserve_bytes`)
and builds every pool into one `Caches` bundle. The KV pool's bytes per token are those of its storage
dtype (`EngineConfig.kv_cache_dtype`: a float8 cache fits twice the tokens of a 16-bit one in the same
budget); the GDN state keeps the model's dtype. The engine hands that bundle to the
scheduler, the only writer of page tables and GDN slot state, and to the model runner, which
only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vlmrun.cache.gdn_pool import GDNPool, GDNSnapshotPool
from vlmrun.cache.kv_pool import KVPool, PageAllocator, ReqToTokenPool, pages_needed
from vlmrun.config import CacheShape, EngineConfig

CPU_KV_BUDGET_BYTES = 2 << 30
GDN_MAX_BUDGET_SHARE = 0.5  # when max_num_seqs GDN slots do not fit, they get at most this share
ACTIVATION_RESERVE_BYTES = 1 << 30  # CUDA: logits and vision activations of one step
# The FlashInfer backend's fixed device buffers (layers/attention/flashinfer_backend.py), one of each
# whatever the number of wrappers: a step plans and runs one wrapper, one decode graph replays at a time.
FLASHINFER_FLOAT_WORKSPACE_BYTES = 256 << 20  # split-kv partial results
FLASHINFER_INT_WORKSPACE_BYTES = 8 << 20  # the wrappers' plans (FlashInfer's own default size)
LONGEST_CONTEXT = 262_144  # the longest max_model_len of the supported families: bounds the graphs' index buffers
# speculative decoding's verify steps are captured in CUDA graphs (`verify_cuda_graphs`) for buckets of at
# most this many tokens (rows x (1 + k)): each holds, per GDN layer, the states after every position of
# its rows in the graphs' memory pool, and FlashInfer plans it as that many decode rows
VERIFY_GRAPH_MAX_TOKENS = 256


@dataclass
class CachePlan:
    """How one cache budget is split between the KV pool and the GDN state pool."""
    num_pages: int  # KV pages, including the dummy page 0
    page_size: int
    max_model_len: int
    max_num_seqs: int  # may be lower than asked when the GDN state of that many requests does not fit
    kv_bytes_per_token: int
    gdn_bytes_per_request: int  # 0 for a model without GDN layers
    num_gdn_slots: int  # max_num_seqs + 1 (slot 0 is the dummy); 0 without GDN layers
    num_gdn_snapshots: int = 0  # GDN states kept for prefix-cache hits (hybrid models)

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    @property
    def gdn_bytes(self) -> int:
        return self.num_gdn_slots * self.gdn_bytes_per_request

    @property
    def gdn_snapshot_bytes(self) -> int:
        return self.num_gdn_snapshots * self.gdn_bytes_per_request


def kv_bytes_per_token(shape: CacheShape, dtype: torch.dtype) -> int:
    return KVPool.bytes_per_token(shape.num_attention_layers, shape.num_kv_heads, shape.head_dim, dtype)


def gdn_bytes_per_request(shape: CacheShape, conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    if not shape.is_hybrid:
        return 0
    return GDNPool.bytes_per_slot(shape.num_gdn_layers, shape.gdn_conv_dim, shape.gdn_conv_kernel,
                                  shape.gdn_num_v_heads, shape.gdn_head_v_dim, shape.gdn_head_k_dim,
                                  conv_dtype, state_dtype)


def plan_cache_memory(shape: CacheShape, budget_bytes: int, *, dtype: torch.dtype, gdn_state_dtype: torch.dtype,
                      max_num_seqs: int, max_model_len: int, page_size: int,
                      max_model_len_fixed: bool, gdn_snapshots: Optional[int] = 0,
                      kv_dtype: Optional[torch.dtype] = None) -> CachePlan:
    """Split one budget: the GDN pool takes `max_num_seqs + 1` slots, the KV pool gets the rest.

    If the GDN state of `max_num_seqs` requests does not fit in the budget, `max_num_seqs` is
    lowered so that the GDN pool takes at most `GDN_MAX_BUDGET_SHARE` of it. KV pages are capped
    at what `max_num_seqs` requests of `max_model_len` tokens can use; `max_model_len` shrinks to
    the KV capacity unless it was set by the user (`max_model_len_fixed`).

    Hybrid models with prefix caching keep GDN state snapshots (`gdn_snapshots`, each the size of
    one request's state): an int takes them from the budget before the KV pool; None takes up to
    `max_num_seqs` of them only from what the KV pool cannot use (the budget beyond
    `max_num_seqs * max_model_len` tokens); 0 keeps none. `kv_dtype`: the KV pool's storage (None: `dtype`).
    """
    per_token = kv_bytes_per_token(shape, kv_dtype or dtype)
    per_request = gdn_bytes_per_request(shape, dtype, gdn_state_dtype)
    seqs = max_num_seqs
    if per_request and (seqs + 1) * per_request > budget_bytes:
        seqs = int(budget_bytes * GDN_MAX_BUDGET_SHARE) // per_request - 1
        if seqs < 1:
            raise ValueError(f"the cache budget of {budget_bytes} bytes cannot hold the GDN state of one request "
                             f"({per_request} bytes each, plus the dummy slot); raise kv_cache_memory_bytes or "
                             f"gpu_memory_utilization")
    num_slots = seqs + 1 if per_request else 0
    kv_budget = budget_bytes - num_slots * per_request
    snapshots = 0
    if per_request and gdn_snapshots:
        snapshots = gdn_snapshots
        kv_budget -= snapshots * per_request
    wanted_tokens = seqs * max_model_len
    tokens = min(kv_budget // per_token, wanted_tokens) if per_token else wanted_tokens
    num_pages = tokens // page_size + 1  # + the dummy page
    if num_pages < 2:
        raise ValueError(f"the KV budget of {kv_budget} bytes holds no page of {page_size} tokens "
                         f"({per_token} bytes per token); raise kv_cache_memory_bytes or gpu_memory_utilization")
    if per_request and gdn_snapshots is None:
        surplus = kv_budget - num_pages * page_size * per_token
        snapshots = min(seqs, max(surplus, 0) // per_request)
    capacity = (num_pages - 1) * page_size
    max_len = max_model_len if max_model_len_fixed else min(max_model_len, capacity)
    return CachePlan(num_pages=num_pages, page_size=page_size, max_model_len=max_len, max_num_seqs=seqs,
                     kv_bytes_per_token=per_token, gdn_bytes_per_request=per_request, num_gdn_slots=num_slots,
                     num_gdn_snapshots=snapshots)


@dataclass
class Caches:
    """Every pool of one engine, built from one plan."""
    plan: CachePlan
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    allocator: PageAllocator
    gdn_pool: Optional[GDNPool] = None  # hybrid models only
    gdn_snapshots: Optional[GDNSnapshotPool] = None  # hybrid models with room for prefix-cache snapshots


def cache_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for KV + GDN state: as configured, 2 GiB on CPU, else a share of the GPU left after the weights,
    a step's activations and the attention kernels' fixed buffers."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_KV_BUDGET_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    reserve = ACTIVATION_RESERVE_BYTES + flashinfer_reserve_bytes(config)
    return max(int(total * config.gpu_memory_utilization) - used - reserve, 0)


def flashinfer_reserve_bytes(config: EngineConfig) -> int:
    """Device memory the FlashInfer backend holds beside the pools, or 0 when it cannot be the backend.

    The float and int workspaces (one each), the 8 MiB int workspace each new wrapper allocates before
    it is handed the shared one (freed, kept by torch's allocator for the next), and the decode graphs'
    static index buffers: one set for every page-table row (max_num_seqs + the dummy; with verify graphs at
    least VERIFY_GRAPH_MAX_TOKENS rows), each row's pages at the longest context. "auto" counts: on CUDA it names FlashInfer once the GPU checks pass
    (`layers/attention/factory.py`), and the budget is planned before the backend is built.
    """
    if config.attention_backend not in ("auto", "flashinfer"):
        return 0
    rows = config.max_num_seqs + 1
    if config.verify_cuda_graphs and config.speculative_config is not None:  # a verify graph's positions
        rows = max(rows, VERIFY_GRAPH_MAX_TOKENS)
    pages_per_row = pages_needed(config.max_model_len or LONGEST_CONTEXT, config.page_size)
    index_bytes = 4 * (rows + 1 + rows * pages_per_row + rows)  # int32 indptr, page ids, last-page lengths
    return FLASHINFER_FLOAT_WORKSPACE_BYTES + 2 * FLASHINFER_INT_WORKSPACE_BYTES + index_bytes


def build_caches(shape: CacheShape, config: EngineConfig, *, dtype: torch.dtype, max_model_len: int,
                 device: torch.device) -> Caches:
    """Plan the budget for `shape` (the model's caches) and build the pools on `device`."""
    plan = plan_for_budget(shape, config, cache_budget_bytes(config, device), dtype=dtype, max_model_len=max_model_len)
    return build_pools(shape, plan, config, dtype=dtype, device=device)


def plan_for_budget(shape: CacheShape, config: EngineConfig, budget_bytes: int, *, dtype: torch.dtype,
                    max_model_len: int) -> CachePlan:
    """`plan_cache_memory` with the engine's settings (tensor-parallel ranks: the smallest rank budget)."""
    return plan_cache_memory(shape, budget_bytes, dtype=dtype,
                             gdn_state_dtype=config.gdn_state_torch_dtype, max_num_seqs=config.max_num_seqs,
                             max_model_len=max_model_len, page_size=config.page_size,
                             max_model_len_fixed=config.max_model_len is not None,
                             gdn_snapshots=config.gdn_prefix_snapshots if config.enable_prefix_caching else 0,
                             kv_dtype=config.kv_cache_torch_dtype(dtype))


def build_pools(shape: CacheShape, plan: CachePlan, config: EngineConfig, *, dtype: torch.dtype,
                device: torch.device) -> Caches:
    """Every pool of `plan` on `device`."""
    kv_pool = KVPool(shape.num_attention_layers, plan.num_pages * plan.page_size, shape.num_kv_heads,
                     shape.head_dim, config.kv_cache_torch_dtype(dtype), device, plan.page_size, compute_dtype=dtype)
    caches = Caches(plan=plan, kv_pool=kv_pool, req_to_token=ReqToTokenPool(plan.max_num_seqs, plan.max_model_len, device),
                    allocator=PageAllocator(plan.num_pages, plan.page_size))
    if shape.is_hybrid:
        caches.gdn_pool = GDNPool(shape.num_gdn_layers, plan.num_gdn_slots, shape.gdn_conv_dim,
                                  shape.gdn_conv_kernel, shape.gdn_num_v_heads, shape.gdn_head_v_dim,
                                  shape.gdn_head_k_dim, dtype, config.gdn_state_torch_dtype, device)
        if plan.num_gdn_snapshots:
            caches.gdn_snapshots = GDNSnapshotPool(caches.gdn_pool, plan.num_gdn_snapshots)
    return caches
