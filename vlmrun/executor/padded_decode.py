"""Decode steps padded to a batch-size bucket, replayed from a CUDA graph per bucket where possible.

A decode step of B sequences runs as the smallest bucket b >= B of `decode_buckets(max_num_seqs)`
(1, 2, 4, 8, then every 8). Its inputs are copied into static buffers sized for the largest
bucket; the b - B padding rows are harmless by construction: token 0 at position 0, one cached
token, page-table row `dummy_row` (all zeros: the dummy page), KV slot 0 (the dummy page) and GDN
slot 0 (the dummy slot). Padding rows therefore read and write only the dummy page and the dummy
GDN slot, never a live one. Their outputs are dropped.

With CUDA graphs (CUDA, `enforce_eager=False`, backends that support capture, a model without
host syncs), each bucket's forward is captured once at start-up and replayed; otherwise the same
padded batch runs eagerly (always on the CPU), so the padding logic is exercised everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.cache.plan import Caches
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

PAD_KV_SLOT = 0  # slot 0 of the dummy page
PAD_GDN_SLOT = 0  # the GDN pool's dummy slot


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to: 1, 2, 4, 8, 16, 24, ... and max_num_seqs itself."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return buckets + [max_num_seqs]


def bucket_for(batch_size: int, buckets: list[int]) -> Optional[int]:
    """The smallest bucket that holds `batch_size` sequences, or None when none does."""
    return next((b for b in buckets if b >= batch_size), None)


def graph_capturable(model: nn.Module) -> bool:
    """False when a module of the model syncs with the host in its forward (e.g. MoE routing counts)."""
    return all(getattr(m, "cuda_graph_capturable", True) for m in model.modules())


class DecodeInputs:
    """The static input buffers of padded decode steps, sized for the largest bucket."""

    def __init__(self, max_batch: int, dummy_row: int, hybrid: bool, device: torch.device):
        self.dummy_row = dummy_row
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(3, max_batch, **long)
        self.req_pool_indices = torch.full((max_batch,), dummy_row, **long)
        self.seq_lens = torch.ones(max_batch, **long)
        self.prefix_lens = torch.zeros(max_batch, **long)
        self.out_cache_loc = torch.full((max_batch,), PAD_KV_SLOT, **long)
        self.state_slots = torch.full((max_batch,), PAD_GDN_SLOT, **long) if hybrid else None
        self.ones = torch.ones(max_batch, **long)  # every row feeds one token

    def fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        """Copy the decode batch `fb` into the buffers, pad it to `bucket` rows, return the padded batch."""
        n = fb.batch_size
        self.input_ids[:n].copy_(fb.input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:, :n].copy_(fb.positions)
        self.positions[:, n:bucket].zero_()
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.req_pool_indices[n:bucket].fill_(self.dummy_row)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.seq_lens[n:bucket].fill_(1)
        self.prefix_lens[:n].copy_(fb.extend_prefix_lens)
        self.prefix_lens[n:bucket].zero_()
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        self.out_cache_loc[n:bucket].fill_(PAD_KV_SLOT)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(fb.state_slots)
            self.state_slots[n:bucket].fill_(PAD_GDN_SLOT)
        pad = bucket - n
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:, :bucket],
            req_pool_indices=self.req_pool_indices[:bucket],
            seq_lens=self.seq_lens[:bucket],
            extend_prefix_lens=self.prefix_lens[:bucket],
            extend_seq_lens=self.ones[:bucket],
            out_cache_loc=self.out_cache_loc[:bucket],
            seq_lens_cpu=fb.seq_lens_cpu + [1] * pad,
            extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu + [0] * pad,
            extend_seq_lens_cpu=[1] * bucket,
            logits_indices=fb.logits_indices,
            attn_backend=fb.attn_backend,
            state_slots=None if self.state_slots is None else self.state_slots[:bucket],
        )


@dataclass
class CapturedDecode:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden]: the graph's output buffer
    attn_state: Any  # the backend's static metadata for this bucket


class PaddedDecodeRunner:
    """Runs decode steps padded to buckets: from captured CUDA graphs, or eagerly."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, caches: Caches, device: torch.device,
                 use_cuda_graphs: bool):
        self.model = model
        self.backend = backend
        self.buckets = decode_buckets(caches.plan.max_num_seqs)
        self.inputs = DecodeInputs(self.buckets[-1], caches.req_to_token.dummy_row, caches.gdn_pool is not None, device)
        self.graphs: dict[int, CapturedDecode] = {}
        if use_cuda_graphs:
            self.capture()

    def fits(self, fb: ForwardBatch) -> bool:
        """A decode step of at most the largest bucket, with no image rows."""
        return (fb.mode is ForwardMode.DECODE and fb.mm_mask is None
                and bucket_for(fb.batch_size, self.buckets) is not None)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The decode step `fb` -> hidden states [batch, hidden] of its real rows."""
        bucket = bucket_for(fb.batch_size, self.buckets)
        padded = self.inputs.fill(fb, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            self.backend.prepare(padded)
            hidden = self.model(padded.input_ids, padded.positions, padded)
        else:
            self.backend.prepare_graph(captured.attn_state, padded)
            captured.graph.replay()
            hidden = captured.hidden
        return hidden[: fb.batch_size]

    # ------------------------------------------------------------------ CUDA graphs

    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        pool = None
        for bucket in reversed(self.buckets):
            state = self.backend.graph_metadata(bucket)
            padded = self._all_padding(bucket)
            self.backend.prepare_graph(state, padded)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: autotuning and lazy init outside the capture
                for _ in range(2):
                    self.model(padded.input_ids, padded.positions, padded)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(padded.input_ids, padded.positions, padded)
            pool = graph.pool()
            self.graphs[bucket] = CapturedDecode(graph, hidden, state)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _all_padding(self, bucket: int) -> ForwardBatch:
        """A decode batch of `bucket` padding rows: what a graph is captured on."""
        none = self.inputs.ones[:0]
        empty = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=none, positions=self.inputs.positions[:, :0], req_pool_indices=none,
            seq_lens=none, extend_prefix_lens=none, extend_seq_lens=none, out_cache_loc=none, seq_lens_cpu=[],
            extend_prefix_lens_cpu=[], extend_seq_lens_cpu=[], logits_indices=none, attn_backend=self.backend,
            state_slots=None if self.inputs.state_slots is None else none)
        return self.inputs.fill(empty, bucket)
