"""Runs one scheduled step: builds the ForwardBatch, encodes images, runs the model, samples.

The runner owns the model, the KV pool, the request-to-token map and the attention backend; for a
hybrid model (GDN layers) also the GDN state pool, behind a `HybridAttnBackend`. KV and GDN state
are sized from one budget (`plan_cache_memory`). It reads the scheduler's chunks and returns the
sampled token (and logprobs) of every chunk that reaches its request's last known token. The one
device→host sync of a step is the `.tolist()` of the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vlmrun.cache.encoder_cache import EncoderCache
from vlmrun.cache.gdn_pool import GDNPool, GDNSnapshotPool, gdn_slot_for_row
from vlmrun.cache.kv_pool import KVPool, PageAllocator, ReqToTokenPool
from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.engine.scheduler import ScheduledChunk
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import AttentionBackend
from vlmrun.layers.attention.gdn_backend import GDNBackend
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend
from vlmrun.layers.sampler import Sampler, SamplingBatch, SamplingRow
from vlmrun.loader import load_model
from vlmrun.multimodal.vision_stage import ChunkSpan, VisionStage

CPU_KV_BUDGET_BYTES = 2 << 30
GDN_MAX_BUDGET_SHARE = 0.5  # when max_num_seqs GDN slots do not fit, they get at most this share


@dataclass
class SampledToken:
    token_id: int
    logprobs: Optional[dict[int, float]]


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
    return GDNPool.bytes_per_slot(shape.num_linear_layers, shape.linear_conv_dim, shape.linear_conv_kernel,
                                  shape.linear_num_v_heads, shape.linear_head_v_dim, shape.linear_head_k_dim,
                                  conv_dtype, state_dtype)


def plan_cache_memory(shape: CacheShape, budget_bytes: int, *, dtype: torch.dtype, gdn_state_dtype: torch.dtype,
                      max_num_seqs: int, max_model_len: int, page_size: int,
                      max_model_len_fixed: bool, gdn_snapshots: Optional[int] = 0) -> CachePlan:
    """Split one budget: the GDN pool takes `max_num_seqs + 1` slots, the KV pool gets the rest.

    If the GDN state of `max_num_seqs` requests does not fit in the budget, `max_num_seqs` is
    lowered so that the GDN pool takes at most `GDN_MAX_BUDGET_SHARE` of it. KV pages are capped
    at what `max_num_seqs` requests of `max_model_len` tokens can use; `max_model_len` shrinks to
    the KV capacity unless it was set by the user (`max_model_len_fixed`).

    Hybrid models with prefix caching keep GDN state snapshots (`gdn_snapshots`, each the size of
    one request's state): an int takes them from the budget before the KV pool; None takes up to
    `max_num_seqs` of them only from what the KV pool cannot use (the budget beyond
    `max_num_seqs * max_model_len` tokens); 0 keeps none.
    """
    per_token = kv_bytes_per_token(shape, dtype)
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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device):
        self.device = device
        self.model_config = model_config
        self.engine_config = engine_config
        self.model = load_model(model_config, device)
        self.page_size = engine_config.page_size
        self.cache_shape = CacheShape.from_model(self.model)
        plan = plan_cache_memory(self.cache_shape, self._cache_budget_bytes(), dtype=model_config.dtype,
                                 gdn_state_dtype=engine_config.gdn_state_torch_dtype,
                                 max_num_seqs=engine_config.max_num_seqs, max_model_len=model_config.max_model_len,
                                 page_size=self.page_size, max_model_len_fixed=engine_config.max_model_len is not None,
                                 gdn_snapshots=(engine_config.gdn_prefix_snapshots
                                                if engine_config.enable_prefix_caching else 0))
        self.cache_plan = plan
        self.max_model_len = plan.max_model_len
        self.max_num_seqs = plan.max_num_seqs
        self.kv_bytes_per_token = plan.kv_bytes_per_token
        self.gdn_bytes_per_request = plan.gdn_bytes_per_request
        shape = self.cache_shape
        self.kv_pool = KVPool(shape.num_attention_layers, plan.num_pages * self.page_size, shape.num_kv_heads,
                              shape.head_dim, model_config.dtype, device, self.page_size)
        self.req_pool = ReqToTokenPool(self.max_num_seqs, self.max_model_len, device)
        self.allocator = PageAllocator(plan.num_pages, self.page_size)
        self.gdn_pool: Optional[GDNPool] = None
        self.gdn_snapshots: Optional[GDNSnapshotPool] = None  # prefix-cache snapshots (hybrid models)
        self.attn_backend: AttentionBackend = TorchAttnBackend(self.kv_pool, self.req_pool)
        if shape.is_hybrid:
            self.gdn_pool = GDNPool(shape.num_linear_layers, plan.num_gdn_slots, shape.linear_conv_dim,
                                    shape.linear_conv_kernel, shape.linear_num_v_heads, shape.linear_head_v_dim,
                                    shape.linear_head_k_dim, model_config.dtype,
                                    engine_config.gdn_state_torch_dtype, device)
            self.attn_backend = HybridAttnBackend(self.attn_backend, GDNBackend(self.gdn_pool))
            if plan.num_gdn_snapshots:
                self.gdn_snapshots = GDNSnapshotPool(self.gdn_pool, plan.num_gdn_snapshots)
        self.vision = (VisionStage(self.model, EncoderCache(engine_config.encoder_cache_tokens), device,
                                   model_config.dtype) if hasattr(self.model, "encode_images") else None)
        self.sampler = Sampler()

    # ------------------------------------------------------------------ set-up

    def _cache_budget_bytes(self) -> int:
        if self.engine_config.kv_cache_memory_bytes is not None:
            return self.engine_config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_KV_BUDGET_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        activation_reserve = 1 << 30  # logits, vision activations and workspace of one step
        return max(int(total * self.engine_config.gpu_memory_utilization) - used - activation_reserve, 0)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[Optional[SampledToken]]:
        """Runs the chunks; returns, per chunk, its sampled token or None for a mid-prompt chunk."""
        fb = self.build_forward_batch(chunks)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)  # [num_tokens, hidden]
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return [None] * len(chunks)
        logits = self.model.compute_logits(hidden[fb.logits_indices])  # [num_sampled, vocab] float32
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator, r.eos_token_ids)
                for r in (c.request for c in sampling)]
        batch = SamplingBatch.build(rows, logits.shape[-1], device=self.device)
        host = self.sampler.sample(logits, batch).to_host()  # the step's one device→host sync
        token_ids, logprobs = host.token_ids, host.logprobs
        results: list[Optional[SampledToken]] = []
        k = 0
        for c in chunks:
            if c.samples:
                results.append(SampledToken(token_ids[k], logprobs[k]))
                k += 1
            else:
                results.append(None)
        return results

    def build_forward_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        input_ids: list[int] = []
        positions, cache_locs, spans, logits_rows = [], [], [], []
        for c in chunks:
            req = c.request
            slots = self._slots(req.pages, c.start, c.end)  # [num_tokens] KV slots of this chunk
            self.req_pool.req_to_token[req.req_pool_idx, c.start:c.end] = slots.to(self.device)
            cache_locs.append(slots)
            if req.prompt.mm_items and c.start < req.num_prompt_tokens:
                spans.append(ChunkSpan(req.prompt.mm_items, c.start, c.end, len(input_ids)))
            input_ids.extend(req.token_ids_slice(c.start, c.end))
            positions.append(req.positions_slice(c.start, c.end))
            if c.samples:
                logits_rows.append(len(input_ids) - 1)
        extend_lens = [c.num_tokens for c in chunks]
        prefix_lens = [c.start for c in chunks]
        seq_lens = [c.end for c in chunks]
        dev = self.device
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev),
            positions=torch.cat(positions, dim=1).to(dev),
            req_pool_indices=torch.tensor([c.request.req_pool_idx for c in chunks], dtype=torch.int64).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(dev),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64).to(dev),
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64).to(dev),
            out_cache_loc=torch.cat(cache_locs).to(dev),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev),
            attn_backend=self.attn_backend,
        )
        if self.gdn_pool is not None:
            fb.state_slots = self._prepare_gdn_slots(chunks)
        if spans and self.vision is not None:
            vision = self.vision.prepare(spans, len(input_ids))
            if vision is not None:
                fb.mm_mask, fb.mm_embeds, fb.deepstack_embeds = vision.mm_mask, vision.mm_embeds, vision.deepstack_embeds
        return fb

    def _prepare_gdn_slots(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The GDN slot of each chunk's request [batch]; zeroes the slots of requests starting a prefill."""
        slots = [gdn_slot_for_row(c.request.req_pool_idx) for c in chunks]
        fresh = [slot for c, slot in zip(chunks, slots) if c.start == 0]
        if fresh:
            self.gdn_pool.zero(torch.tensor(fresh, dtype=torch.int64).to(self.device))
        return torch.tensor(slots, dtype=torch.int64).to(self.device)

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.tensor(pages, dtype=torch.int64)[pos // self.page_size]
        return page_ids * self.page_size + pos % self.page_size
