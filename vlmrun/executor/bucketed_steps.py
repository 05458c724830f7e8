"""Steps of a fixed width per row (decode: 1, verify: 1 + k) padded to a batch-size bucket, replayed
from a CUDA graph per bucket where possible.

A decode step of B sequences runs as the smallest bucket b >= B of `batch_buckets(max_num_seqs)`
(1, 2, 4, 8, then every 8). Its inputs are copied into static buffers sized for the largest
bucket; the b - B padding rows are harmless by construction: token 0 at position 0, one cached
token, page-table row `dummy_row` (all zeros: the dummy page), KV slot 0 (the dummy page) and GDN
slot 0 (the dummy slot). Padding rows therefore read and write only the dummy page and the dummy
GDN slot, never a live one. Their outputs are dropped.

Speculative decoding's verify steps (every sequence feeds its last token and at most k drafts,
`fb.num_drafts_cpu`) are a bucket shape too: b rows of exactly w = 1 + k positions, b * w tokens.
A sequence with fewer drafts (or none: a plain decode in a verify step) is padded at its end with
positions that feed token 0 and write KV slot 0 (the dummy page); they attend after the real
positions, so no real position sees them, and the GDN state they leave is never kept (the slot
takes the state after the accepted positions, `keep_accepted_states`, each padding row's the state
after its position 0, in the dummy slot). Padding rows are as above with w positions each.

With CUDA graphs (CUDA, `enforce_eager=False`, backends that support capture, a model without
host syncs), each bucket's forward is captured once at start-up and replayed (verify buckets only
with `verify_cuda_graphs=True`, up to `VERIFY_GRAPH_MAX_TOKENS` tokens: unverified on a GPU so far).
Where CUDA cannot capture (the torch attention backend, LoRA, tensor parallelism, experts that read
counts on the host) decode is not padded at all: padding rows without a graph are pure extra work
(`plan_bucketed_steps`). On the CPU, `enforce_eager=False` runs the same padded batches eagerly, so the
padding logic is exercised on every commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.cache.plan import VERIFY_GRAPH_MAX_TOKENS, Caches
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.host_to_device import upload
from vlmrun.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

PAD_KV_SLOT = 0  # slot 0 of the dummy page
PAD_GDN_SLOT = 0  # the GDN pool's dummy slot


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to: 1, 2, 4, 8, 16, 24, ... and max_num_seqs itself."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return buckets + [max_num_seqs]


def bucket_for(batch_size: int, buckets: list[int]) -> Optional[int]:
    """The smallest bucket that holds `batch_size` sequences, or None when none does."""
    return next((b for b in buckets if b >= batch_size), None)


def graph_capturable(model: nn.Module, max_tokens: int) -> bool:
    """False when a module of the model would read a device value on the host in a decode step of up to
    `max_tokens` tokens (a module says so with `step_capturable(num_tokens)`: MoE experts the per-expert
    loop reads counts for, `SparseMoeBlock`)."""
    return all(m.step_capturable(max_tokens) for m in model.modules() if hasattr(m, "step_capturable"))


@dataclass(frozen=True)
class BucketedStepPlan:
    """How decode and verify steps run on a device: padded to buckets or not, replayed from CUDA graphs or not, and why."""

    padded: bool
    graphs: bool
    why: str


def plan_bucketed_steps(device_type: str, eager: bool, backend_captures: bool, model_captures: bool,
                        tensor_parallel_size: int = 1, lora: bool = False) -> BucketedStepPlan:
    """`eager`: `EngineConfig.enforces_eager` (enforce_eager, by default True on the CPU only). Padding buys
    nothing without a graph to replay (the padding rows are pure extra work), so on CUDA decode is padded
    exactly when it is captured. The CPU pads only when asked (`enforce_eager=False`): no graph there
    either, but the path the graphs replay is then checked on every commit (tests, benchmarks)."""
    if eager:
        return BucketedStepPlan(False, False, "unpadded, eager (enforce_eager)")
    if device_type != "cuda":
        return BucketedStepPlan(True, False, f"padded to buckets, run eagerly: no CUDA graphs on {device_type}")
    refusals = [why for fits, why in (
        (backend_captures, "the attention backend has none (attention_backend='flashinfer' does)"),
        (model_captures, "a module would read a device value on the host (quantized MoE experts, or experts too "
                         "large for the gathered fallback without torch's fast grouped GEMM)"),
        (tensor_parallel_size == 1, "tensor parallelism (collectives inside a capture: not attempted yet)"),
        (not lora, "LoRA (a graph would keep the adapter groups of its capture)")) if not fits]
    if refusals:
        return BucketedStepPlan(False, False, "unpadded, eager: no CUDA graphs (" + "; ".join(refusals) + ")")
    return BucketedStepPlan(True, True, "padded to buckets, replayed from CUDA graphs")


class BucketedStepInputs:
    """The static input buffers of bucketed steps (decode and verify), sized for the largest bucket."""

    def __init__(self, max_batch: int, dummy_row: int, hybrid: bool, device: torch.device, width: int = 1):
        self.dummy_row = dummy_row
        self.device = device
        self.width = width  # positions per row of a verify step (1 + k); 1 without speculative decoding
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch * width, **long)
        self.positions = torch.zeros(3, max_batch * width, **long)
        self.req_pool_indices = torch.full((max_batch,), dummy_row, **long)
        self.seq_lens = torch.ones(max_batch, **long)
        self.prefix_lens = torch.zeros(max_batch, **long)
        self.out_cache_loc = torch.full((max_batch * width,), PAD_KV_SLOT, **long)
        self.state_slots = torch.full((max_batch,), PAD_GDN_SLOT, **long) if hybrid else None
        self.ones = torch.ones(max_batch, **long)  # every row feeds one token
        self.widths = torch.full((max_batch,), width, **long)  # every row of a verify step feeds `width`

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
        self._fill_slots(fb, bucket)
        return ForwardBatch.build(  # one token a row: a DECODE batch
            input_ids=self.input_ids[:bucket], positions=self.positions[:, :bucket],
            req_pool_indices=self.req_pool_indices[:bucket],
            extend_prefix_lens=fb.extend_prefix_lens_cpu + [0] * (bucket - n), extend_seq_lens=[1] * bucket,
            out_cache_loc=self.out_cache_loc[:bucket], logits_indices=fb.logits_indices, to_device=self.upload,
            attn_backend=fb.attn_backend, state_slots=None if self.state_slots is None else self.state_slots[:bucket],
            device_lens=(self.seq_lens[:bucket], self.prefix_lens[:bucket], self.ones[:bucket]))

    def fill_verify(self, fb: ForwardBatch, bucket: int) -> tuple[ForwardBatch, torch.Tensor]:
        """Copy the verify step `fb` into the buffers as `bucket` rows of `width` positions each; return
        the padded batch and, per token of `fb`, its row in the padded stream ([num_tokens] on the device)."""
        n, w = fb.batch_size, self.width
        lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)  # [n] 1 + drafts each
        firsts = torch.cumsum(lens, 0) - lens
        real = (torch.repeat_interleave(torch.arange(n) * w, lens)
                + torch.arange(int(lens.sum())) - torch.repeat_interleave(firsts, lens))  # [num_tokens]
        real = upload(real, self.device)
        tokens = bucket * w
        self.input_ids[:tokens].zero_()
        self.input_ids.index_copy_(0, real, fb.input_ids)
        self.positions[:, :tokens].zero_()
        self.positions.index_copy_(1, real, fb.positions)
        self.out_cache_loc[:tokens].fill_(PAD_KV_SLOT)
        self.out_cache_loc.index_copy_(0, real, fb.out_cache_loc)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.req_pool_indices[n:bucket].fill_(self.dummy_row)
        self.prefix_lens[:n].copy_(fb.extend_prefix_lens)
        self.prefix_lens[n:bucket].zero_()
        torch.add(self.prefix_lens[:bucket], w, out=self.seq_lens[:bucket])
        self._fill_slots(fb, bucket)
        padded = ForwardBatch.build(  # w > 1 tokens a row: an EXTEND batch, its last w - 1 positions drafts
            input_ids=self.input_ids[:tokens], positions=self.positions[:, :tokens],
            req_pool_indices=self.req_pool_indices[:bucket],
            extend_prefix_lens=fb.extend_prefix_lens_cpu + [0] * (bucket - n), extend_seq_lens=[w] * bucket,
            out_cache_loc=self.out_cache_loc[:tokens], logits_indices=fb.logits_indices, to_device=self.upload,
            attn_backend=fb.attn_backend, state_slots=None if self.state_slots is None else self.state_slots[:bucket],
            num_drafts=[w - 1] * bucket, real_fed_lens=fb.extend_seq_lens_cpu + [0] * (bucket - n),
            device_lens=(self.seq_lens[:bucket], self.prefix_lens[:bucket], self.widths[:bucket]))
        return padded, real

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the buffers' device (`vlmrun.host_to_device.upload`)."""
        return upload(host, self.device)

    def _fill_slots(self, fb: ForwardBatch, bucket: int) -> None:
        if self.state_slots is not None:
            self.state_slots[:fb.batch_size].copy_(fb.state_slots)
            self.state_slots[fb.batch_size:bucket].fill_(PAD_GDN_SLOT)


@dataclass
class CapturedStep:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket * width, hidden]: the graph's output buffer
    attn_state: Any  # the backend's static metadata for this bucket
    gdn_state: Any = None  # the GDN backend's metadata at capture (a verify graph's per-position states)


class BucketedStepRunner:
    """Runs decode steps (and verify steps) padded to buckets: from captured CUDA graphs, or eagerly."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, caches: Caches, device: torch.device,
                 use_cuda_graphs: bool, num_speculative_tokens: int = 0, verify_cuda_graphs: bool = False):
        self.model = model
        self.backend = backend
        self.buckets = batch_buckets(caches.plan.max_num_seqs)
        self.width = 1 + num_speculative_tokens  # a verify step's positions per row
        self.max_context = caches.req_to_token.req_to_token.shape[1]  # positions a page-table row holds
        self.inputs = BucketedStepInputs(self.buckets[-1], caches.req_to_token.dummy_row, caches.gdn_pool is not None,
                                         device, self.width)
        self.graphs: dict[int, CapturedStep] = {}
        self.verify_graphs: dict[int, CapturedStep] = {}
        if use_cuda_graphs:
            self.capture(verify=verify_cuda_graphs and self.width > 1)

    def fits(self, fb: ForwardBatch) -> bool:
        """A decode step, or a verify step of at most k drafts per sequence, of at most the largest
        bucket, with no image rows."""
        if fb.mm_mask is not None or bucket_for(fb.batch_size, self.buckets) is None:
            return False
        if fb.mode is ForwardMode.DECODE:
            return True
        return self.fits_verify(fb)

    def fits_verify(self, fb: ForwardBatch) -> bool:
        """Every sequence feeds its last token and its drafts (at most k), and `width` positions from
        its prefix stay inside its page-table row."""
        drafts = fb.num_drafts_cpu
        return (drafts is not None and self.width > 1
                and all(n == 1 + d and d < self.width for n, d in zip(fb.extend_seq_lens_cpu, drafts))
                and max(fb.extend_prefix_lens_cpu) + self.width <= self.max_context)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The decode or verify step `fb` -> hidden states [num_tokens, hidden] of its real tokens. A
        verify step's GDN metadata (the states it keeps per position) is left on `fb` for
        `keep_accepted_states`."""
        bucket = bucket_for(fb.batch_size, self.buckets)
        if fb.mode is ForwardMode.DECODE:
            padded, real = self.inputs.fill(fb, bucket), None
            captured = self.graphs.get(bucket)
        else:
            padded, real = self.inputs.fill_verify(fb, bucket)
            captured = self.verify_graphs.get(bucket)
        if captured is None:
            self.backend.prepare(padded)
            hidden = self.model(padded.input_ids, padded.positions, padded)
        else:
            self.backend.prepare_graph(captured.attn_state, padded)
            padded.gdn_metadata = captured.gdn_state
            captured.graph.replay()
            hidden = captured.hidden
        if real is None:
            return hidden[: fb.batch_size]
        fb.gdn_metadata = padded.gdn_metadata
        return hidden.index_select(0, real)

    # ------------------------------------------------------------------ CUDA graphs

    def capture(self, verify: bool) -> None:
        """Capture one graph per bucket, verify buckets (the most tokens) first, largest first, sharing
        one memory pool."""
        pool = None
        shapes = [(True, b) for b in reversed(self.buckets) if b * self.width <= VERIFY_GRAPH_MAX_TOKENS] if verify else []
        for is_verify, bucket in shapes + [(False, b) for b in reversed(self.buckets)]:
            padded = self._all_padding(bucket, is_verify)
            state = self.backend.graph_metadata(padded.num_tokens)
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
            captured = CapturedStep(graph, hidden, state, padded.gdn_metadata)
            (self.verify_graphs if is_verify else self.graphs)[bucket] = captured
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets,
                    f"; verify graphs ({self.width} tokens a row) for {sorted(self.verify_graphs)}" if verify else "")

    def _all_padding(self, bucket: int, verify: bool) -> ForwardBatch:
        """A decode (or verify) batch of `bucket` padding rows: what a graph is captured on."""
        none = self.inputs.ones[:0]
        empty = ForwardBatch.build(  # no sequence: what `fill` / `fill_verify` pad to `bucket` rows
            input_ids=none, positions=self.inputs.positions[:, :0], req_pool_indices=none, extend_prefix_lens=[],
            extend_seq_lens=[], out_cache_loc=none, logits_indices=none, to_device=self.inputs.upload,
            attn_backend=self.backend, state_slots=None if self.inputs.state_slots is None else none,
            device_lens=(none, none, none))
        return self.inputs.fill_verify(empty, bucket)[0] if verify else self.inputs.fill(empty, bucket)
