"""Runs one scheduled step: builds the ForwardBatch, encodes images, runs the model, samples.

The runner owns the model, the KV pool, the request-to-token map and the attention backend.
It reads the scheduler's chunks and returns the sampled token (and logprobs) of every chunk that
reaches its request's last known token. The one device→host sync of a step is the `.tolist()`
of the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vlmrun.cache.encoder_cache import EncoderCache
from vlmrun.cache.kv_pool import KVPool, PageAllocator, ReqToTokenPool
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.engine.scheduler import ScheduledChunk
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.torch_backend import TorchAttnBackend
from vlmrun.layers.sampler import Sampler, SamplingBatch, SamplingRow
from vlmrun.loader import load_model
from vlmrun.multimodal.vision_stage import ChunkSpan, VisionStage

CPU_KV_BUDGET_BYTES = 2 << 30


@dataclass
class SampledToken:
    token_id: int
    logprobs: Optional[dict[int, float]]


@dataclass
class PoolSizes:
    num_pages: int
    max_model_len: int
    kv_bytes_per_token: int


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device):
        self.device = device
        self.model_config = model_config
        self.engine_config = engine_config
        self.model = load_model(model_config, device)
        self.page_size = engine_config.page_size
        sizes = self._size_pools()
        self.max_model_len = sizes.max_model_len
        self.kv_bytes_per_token = sizes.kv_bytes_per_token
        self.kv_pool = KVPool(self.model.num_attention_layers, sizes.num_pages * self.page_size,
                              self.model.num_kv_heads, self.model.head_dim, model_config.dtype, device,
                              self.page_size)
        self.req_pool = ReqToTokenPool(engine_config.max_num_seqs, self.max_model_len, device)
        self.allocator = PageAllocator(sizes.num_pages, self.page_size)
        self.attn_backend = TorchAttnBackend(self.kv_pool, self.req_pool)
        self.vision = (VisionStage(self.model, EncoderCache(engine_config.encoder_cache_tokens), device,
                                   model_config.dtype) if hasattr(self.model, "encode_images") else None)
        self.sampler = Sampler()

    # ------------------------------------------------------------------ set-up

    def _size_pools(self) -> PoolSizes:
        per_token = KVPool.bytes_per_token(self.model.num_attention_layers, self.model.num_kv_heads,
                                           self.model.head_dim, self.model_config.dtype)
        budget = self._kv_budget_bytes()
        max_len = self.model_config.max_model_len
        wanted_tokens = self.engine_config.max_num_seqs * max_len
        tokens = min(budget // per_token, wanted_tokens)
        num_pages = tokens // self.page_size + 1  # + the dummy page
        if num_pages < 2:
            raise ValueError(f"the KV budget of {budget} bytes holds no page of {self.page_size} tokens "
                             f"({per_token} bytes per token); raise kv_cache_memory_bytes or gpu_memory_utilization")
        capacity = (num_pages - 1) * self.page_size
        if self.engine_config.max_model_len is None:
            max_len = min(max_len, capacity)
        return PoolSizes(num_pages=num_pages, max_model_len=max_len, kv_bytes_per_token=per_token)

    def _kv_budget_bytes(self) -> int:
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
        if spans and self.vision is not None:
            vision = self.vision.prepare(spans, len(input_ids))
            if vision is not None:
                fb.mm_mask, fb.mm_embeds, fb.deepstack_embeds = vision.mm_mask, vision.mm_embeds, vision.deepstack_embeds
        return fb

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.tensor(pages, dtype=torch.int64)[pos // self.page_size]
        return page_ids * self.page_size + pos % self.page_size
