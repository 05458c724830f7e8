"""Runs one step: builds the ForwardBatch, encodes images, runs the model, samples.

The runner owns the model, the attention backend and the vision stage. It reads the caches the
engine built (`vlmrun.cache.plan.Caches`) and writes none of their bookkeeping: the scheduler has
written the page table and zeroed fresh GDN slots before the step, and the attention backends
write K/V and GDN state as the model runs. It returns the sampled token (and logprobs) of every
chunk that reaches its request's last known token. A step is `launch` (all the work; on CUDA it
returns once the work is queued) then `collect` (the sampled ids on the host: the step's one
device→host sync); `execute` is both. A chunk of a request that asked for prompt logprobs also
gets the logits of its prompt positions, and the logprob of each next prompt token with the top-k
(`ChunkInput.prompt_logprobs`; read on the host in `collect`, a second transfer in those steps only). Sampled ids also stay on the device, per page-table row
(`last_tokens`), where a later step reads a token the host does not have yet (`PLACEHOLDER_TOKEN`,
async scheduling). On CUDA the step's inputs go up from pinned host memory with non-blocking copies. Decode steps go through `BucketedStepRunner` (padded to a batch-size bucket,
from a CUDA graph where possible) unless the engine runs eagerly (`enforce_eager`).
A chunk with draft tokens (speculative decoding, `ChunkInput.num_drafts`) samples at each of its last
1 + num_drafts positions; `collect` keeps the tokens up to the first rejected draft
(vlmrun/spec_decode/verify.py). What acceptance decides on the device (a hybrid model's GDN slots take
the states after the accepted positions, the MTP layer's kept outputs, `last_tokens`) is queued by
`launch` itself (`settle_on_device`), so it keeps step order under async scheduling.
A pooling (embedding) chunk samples nothing: its rows of the final hidden states are pooled right after
the forward (`pool`, vlmrun/pooling/pooler.py) and reach the host in `collect` (one transfer, in such steps only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
from torch import nn

from vlmrun.cache.plan import Caches
from vlmrun.executor.mtp_steps import MTPDrafting
from vlmrun.executor.bucketed_steps import BucketedStepRunner
from vlmrun.executor.step_batch import build_forward_batch, placeholder_positions
from vlmrun.executor.step_features import (Adapters, Drafting, HostDrafting, LoRAAdapters, NoAdapters, StepAdapters,
                                           StepDrafts)
from vlmrun.executor.step_input import ChunkInput, DecodeRows, PromptLogprobTargets
from vlmrun.executor.step_output import ChunkOutput, DecodedRows, SampledToken
from vlmrun.executor.step_sampling import StepSampling
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import AttentionBackend
from vlmrun.layers.sampler import Sampler
from vlmrun.layers.sampler_output import SamplerOutput, gather_prompt_logprobs, logprob_dicts
from vlmrun.layers.sampling_state import SamplingState
from vlmrun.lora.manager import LoRAManager
from vlmrun.lora.request import LoRARequest
from vlmrun.models.weights import weight_bytes
from vlmrun.multimodal.vision_stage import ChunkSpan, VisionStage
from vlmrun.host_to_device import int64_tensor, upload
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.pooling.pooler import pool_chunks, pooled_to_host
from vlmrun.executor.mtp_drafter import MTPDrafter
from vlmrun.spec_decode.verify import Verification


@dataclass
class LaunchedStep:
    """A step whose work is queued (on CUDA) or done (on the CPU); `ModelRunner.collect` reads it."""

    samples: list[bool]  # per chunk: it samples a token
    output: Optional[SamplerOutput]  # on its way to the host; None when no chunk samples
    prompt_logprobs: list[Optional[torch.Tensor]]  # per chunk: [m, 3 + 2k] rows (gather_prompt_logprobs) or None
    verification: Optional[Verification] = None  # speculative decoding: the step's drafts and seeded draws
    drafts: Optional[StepDrafts] = None  # this step's drafts (MTP: made on the device, and its outputs)
    num_decodes: int = 0  # decode rows (`DecodeRows`): the first rows of `output`, one each
    decoded: Optional[DecodedRows] = None  # their tokens, once collected
    pooled: Sequence[Optional[torch.Tensor]] = ()  # per chunk (or empty: no pooling chunk): its pooled contribution


class ModelRunner:
    def __init__(self, model: nn.Module, caches: Caches, attn_backend: AttentionBackend,
                 vision: Optional[VisionStage], device: torch.device,
                 bucketed_steps: Optional[BucketedStepRunner] = None, tp: TensorParallel = SINGLE, seed: int = 0,
                 async_scheduling: bool = False, drafter: Optional[MTPDrafter] = None,
                 lora: Optional[LoRAManager] = None):
        self.model = model
        self.drafter = drafter  # speculative method "mtp": drafts on the device (executor/mtp_steps.py)
        self.lora = lora  # LoRA adapters in slots (enable_lora); None: the base model only
        self.weight_bytes = (weight_bytes(model),)  # as stored to run (oneDNN-packed, quantized), one device
        self.caches = caches
        self.attn_backend = attn_backend
        self.vision = vision
        self.device = device
        self.bucketed_steps = bucketed_steps  # None: every step runs eagerly, unpadded
        # unseeded sampled rows draw from one generator started at the engine's seed (EngineConfig.seed)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        # each page-table row's sampling settings and penalty counts, kept from step to step
        self.sampling_state = SamplingState(caches.req_to_token.max_reqs + 1, device)
        self.tp = tp  # under tensor parallel every rank feeds rank 0's sampled tokens to the next step
        self.async_scheduling = async_scheduling  # async scheduling: keep last_tokens (synchronous: unused)
        # the last token sampled for each page-table row (the dummy row included): a step's
        # PLACEHOLDER_TOKEN inputs are read from here, on the device
        self.last_tokens = torch.zeros(caches.req_to_token.max_reqs + 1, dtype=torch.int64, device=device)
        # each page-table row's M-RoPE delta (its request's offset of positions after the prompt), on the host:
        # written by every step for its chunks (a request's first step on a row is a chunk), read by decode rows
        self.row_mrope_deltas = torch.zeros(caches.req_to_token.max_reqs + 1, dtype=torch.int64)
        # the step's features (executor/step_features.py): each row's adapter, and the drafts around the forward
        self.adapters: Adapters = NoAdapters() if lora is None else LoRAAdapters(lora, partial(rows_per_sequence, self.bucketed_steps))
        self.drafting: Drafting = (HostDrafting() if drafter is None
                                   else MTPDrafting(drafter, attn_backend, device, tp))

    def make_generator(self, seed: int) -> torch.Generator:
        """A seeded request's own generator, on the device its noise is drawn on."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def shutdown(self) -> None:
        """Nothing to end: the model runs in this process."""

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check a LoRA adapter now (kept on the host until a step puts it in a slot; the engine
        has refused it already when it was started without enable_lora)."""
        self.lora.add(request)

    def execute(self, chunks: list[ChunkInput]) -> list[ChunkOutput]:
        """Runs the chunks; returns, per chunk, its sampled token (None for a mid-prompt chunk) and prompt logprobs."""
        return self.collect(self.launch(chunks))

    @property
    def takes_decode_rows(self) -> bool:
        """`launch` takes a step's plain decodes as columns (`DecodeRows`, each with its adapter): not with
        MTP drafting, which catches up over every row as a chunk."""
        return self.drafting.takes_decode_rows

    @torch.inference_mode()
    def launch(self, chunks: list[ChunkInput], decodes: Optional[DecodeRows] = None) -> LaunchedStep:
        """Everything of a step but reading its tokens: on CUDA it returns once the work is queued
        (sampled ids stay on the device, in `last_tokens`, and start their copy to the host).
        Prepare the inputs, run the forward, sample, settle what acceptance decides on the device."""
        fb, drafts = self.prepare(chunks, decodes)
        hidden = self.forward(fb)  # [num_tokens, hidden]
        num_decodes = 0 if decodes is None else len(decodes)
        prompt_logprobs = self.compute_prompt_logprobs(hidden[num_decodes:], chunks)  # (the chunks' rows)
        step = LaunchedStep([c.sampling is not None for c in chunks], None, prompt_logprobs, drafts=drafts,
                            num_decodes=num_decodes, pooled=self.pool(hidden[num_decodes:], chunks))
        self.sample(step, chunks, decodes, hidden, fb)
        if step.output is not None:
            self.settle_on_device(chunks, step.output.token_ids, fb, drafts, step.num_decodes, step.verification)
            step.output.start_transfer()
        return step

    def prepare(self, chunks: list[ChunkInput], decodes: Optional[DecodeRows]) -> tuple[ForwardBatch, StepDrafts]:
        """The step's ForwardBatch with its image embeddings and adapter rows bound; drafts made on the device put in."""
        if chunks:  # each chunk's row takes its request's M-RoPE delta (one write for the step's chunks)
            rows, deltas = int64_tensor([c.row for c in chunks]), int64_tensor([c.mrope_delta for c in chunks])
            self.row_mrope_deltas[rows] = deltas
        fb = build_forward_batch(chunks, decodes, self.upload, self.attn_backend, self.caches.gdn_pool is not None,
                                 row_mrope_deltas=self.row_mrope_deltas)
        fb.input_ids = self.fill_placeholders(fb.input_ids, chunks, decodes)
        adapters = self.adapters.activate(chunks, decodes)  # LoRA: the step's adapters in slots
        self.embed_images(fb, chunks, adapters, first_row=0 if decodes is None else len(decodes))
        adapters.bind(fb)  # each row's adapter slot, read by the adapted layers of this forward
        drafts = self.drafting.start(chunks)
        drafts.draft(fb)  # MTP: the speculating chunks' drafts, made on the device, into fb.input_ids
        return fb, drafts

    def sample(self, step: LaunchedStep, chunks: list[ChunkInput], decodes: Optional[DecodeRows],
               hidden: torch.Tensor, fb: ForwardBatch) -> None:
        """Sample at the step's logits rows (a row per verified position of a speculating chunk); the
        output goes on `step` (None when nothing samples; MTP still catches up over the fed tokens)."""
        drafts = step.drafts
        verification = None if not any(c.num_drafts for c in chunks) else Verification.of(
            [c.sampling for c in chunks], [c.draft_token_ids for c in chunks])
        step.verification = verification
        if verification is not None:  # a row per verified position
            rows = verification.position_rows(self._draft_masks(chunks, drafts))
        else:
            rows = [c.sampling for c in chunks if c.sampling is not None]
        if decodes is not None:  # the step's first rows (their list itself when alone: `SamplingState.gather`)
            rows = decodes.sampling + rows if rows else decodes.sampling
        if not rows:
            drafts.catch_up(hidden, fb, None)
            return
        # a step of decode rows alone samples at its first rows, in order: a view, not a gather
        sampled_rows = hidden[:len(decodes)] if decodes is not None and not chunks else hidden[fb.logits_indices]
        logits = self.model.compute_logits(sampled_rows)  # [num_sampled positions, vocab] float32
        vocab = logits.shape[-1]
        if verification is not None:
            verification.before_sampling(vocab, self.device)
        # the batch, from each page-table row's kept settings and counts (MTP's drafts are on the device)
        sampling = StepSampling.of(self.sampling_state, rows, vocab, chunks, decodes, verification,
                                   drafts.reads_samples, self.device)
        output = self.sampler.sample(logits, sampling.batch)
        if self.async_scheduling or drafts.reads_samples or verification is not None:
            # (tensor parallel) async scheduling: the next step may read these ids before the host does;
            # speculation: every rank accepts what rank 0 sampled (its GDN slots, MTP layer, generators)
            self.tp.broadcast_from_first(output.token_ids)
        sampling.record(self.sampling_state, output.token_ids, self.device)  # penalty counts: the kept tokens
        drafts.catch_up(hidden, fb, output.token_ids)
        step.output = output

    def settle_on_device(self, chunks: list[ChunkInput], sampled: torch.Tensor, fb: ForwardBatch,
                         drafts: StepDrafts, num_decodes: int = 0,
                         verification: Optional[Verification] = None) -> None:
        """What acceptance decides on the device, queued with the step itself (`accepted_on_device`, no
        sync): each verified GDN slot takes the states after its accepted positions, each sampling row's
        MTP output its last kept position, and (async scheduling) `last_tokens` each row's last token.
        Under async scheduling the host reads a step's tokens after the next step is launched; writes made
        then would land after that step's cache writes (a slot zeroed or restored for a new owner).
        The step's `num_decodes` decode rows (`DecodeRows`, before the chunks) sample one row each, first."""
        first_rows, row = [], num_decodes  # each chunk's first row in `sampled` [sampled positions]
        if verification is not None or self.async_scheduling:
            for c in chunks:
                first_rows.append(row)
                row += 1 + c.num_drafts if c.sampling is not None else 0
        accepted = None  # [chunks] the drafts each keeps, on the device (None: the step verifies none)
        if verification is not None:
            accepted = verification.accepted_on_device(sampled, first_rows, drafts.drafted, self.device)
            if self.attn_backend.gdn is not None:  # GDN slots: the states after the accepted positions
                self.attn_backend.gdn.keep_accepted_states(fb.gdn_metadata, accepted)
        drafts.remember(accepted)  # MTP: each row's output at its last kept position
        if not self.async_scheduling:
            return
        sampling = [(c.row, i, first_rows[i]) for i, c in enumerate(chunks) if c.sampling is not None]
        if sampling:  # one upload: [3, sampling chunks] page-table row, chunk, first sampled row
            rows, chunk_index, first = self.upload(torch.tensor(sampling, dtype=torch.int64).T.contiguous())
            self.last_tokens[rows] = sampled[first if accepted is None else first + accepted[chunk_index]]
        if num_decodes:  # the decode rows: the step's first rows of `sampled`, one each
            self.last_tokens[fb.req_pool_indices[:num_decodes]] = sampled[:num_decodes]

    @staticmethod
    def _draft_masks(chunks: list[ChunkInput], drafts: StepDrafts) -> list[Optional[list]]:
        """Per chunk: the grammar masks of its positions after the drafts (None without a grammar or drafts).
        MTP drafts are read from the device for them first (a sync, in steps with such a chunk only)."""
        if not any(c.draft_grammar is not None for c in chunks):
            return [None] * len(chunks)
        on_host = drafts.drafts_on_host()
        return [None if c.draft_grammar is None else c.draft_grammar.after_drafts(d) for c, d in zip(chunks, on_host)]

    def compute_prompt_logprobs(self, hidden: torch.Tensor, chunks: list[ChunkInput]) -> list[Optional[torch.Tensor]]:
        """Per chunk with `prompt_logprobs` targets: the logits of its first m fed tokens (each followed by
        a prompt token) -> [m, 3 + 2k] rows (`gather_prompt_logprobs`); None for the other chunks."""
        out: list[Optional[torch.Tensor]] = []
        if all(c.prompt_logprobs is None for c in chunks):
            return [None] * len(chunks)
        offset = 0
        for c in chunks:
            targets: Optional[PromptLogprobTargets] = c.prompt_logprobs
            if targets is None or not targets.next_token_ids:
                out.append(None)
            else:
                m = len(targets.next_token_ids)
                logits = self.model.compute_logits(hidden[offset:offset + m])  # [m, vocab] float32
                next_ids = self.upload(torch.tensor(targets.next_token_ids, dtype=torch.int64))  # [m]
                out.append(gather_prompt_logprobs(logits, next_ids, targets.num_logprobs))
            offset += c.num_tokens
        return out

    def collect(self, step: LaunchedStep) -> list[ChunkOutput]:
        """The step's sampled tokens on the host: the step's one device→host sync (and, in a step with
        prompt logprobs, their rows). Per chunk; the decode rows' tokens are left on `step.decoded`."""
        outputs = [ChunkOutput() for _ in step.samples]
        if step.output is not None:
            host = step.output.to_host()
            n = step.num_decodes  # the first rows, one a decode row
            if n:
                step.decoded = DecodedRows(host.token_ids[:n], host.logprobs[:n])
            sampled = iter(zip(host.token_ids[n:], host.logprobs[n:]) if n else zip(host.token_ids, host.logprobs))
            verification = step.verification
            if verification is None:  # nothing verified: one token a sampling chunk
                for out, samples in zip(outputs, step.samples):
                    if samples:
                        out.sampled = SampledToken(*next(sampled))
            else:
                step_drafts = step.drafts.drafts_on_host()
                for out, samples, drafts, seeded in zip(outputs, step.samples, step_drafts, verification.seeded):
                    if samples:
                        tokens = [SampledToken(*next(sampled)) for _ in range(1 + len(drafts))]
                        accepted = verification.emitted([t.token_id for t in tokens], drafts, seeded)
                        out.sampled, out.after_drafts = tokens[0], tokens[1:1 + accepted]
        for out, vector in zip(outputs, pooled_to_host(step.pooled)):  # (one transfer, in steps with pooling only)
            out.pooled = vector
        for out, rows in zip(outputs, step.prompt_logprobs):
            if rows is not None:
                k = (rows.shape[1] - 3) // 2
                out.prompt_logprobs = logprob_dicts(rows.tolist(), k)
        return outputs

    @staticmethod
    def pool(hidden: torch.Tensor, chunks: list[ChunkInput]) -> list[Optional[torch.Tensor]]:
        """Pooling (embedding) chunks: each one's contribution [hidden] from its rows of the final hidden
        states (vlmrun/pooling/pooler.py); empty when no chunk pools."""
        if all(c.pooling is None for c in chunks):
            return []
        return pool_chunks(hidden, [c.pooling for c in chunks], [c.num_tokens for c in chunks])

    def collect_step(self, step: LaunchedStep) -> tuple[list[ChunkOutput], Optional[DecodedRows]]:
        """`collect`, and the decode rows' tokens (None when the step had none)."""
        return self.collect(step), step.decoded

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model over the step's tokens -> hidden states [num_tokens, hidden]."""
        if self.bucketed_steps is not None and self.bucketed_steps.fits(fb):
            return self.bucketed_steps.run(fb)
        self.attn_backend.prepare(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def fill_placeholders(self, input_ids: torch.Tensor, chunks: list[ChunkInput],
                          decodes: Optional[DecodeRows] = None) -> torch.Tensor:
        """`input_ids` [num_tokens] (on the device) with each PLACEHOLDER_TOKEN replaced there by the last
        token sampled for its row (async scheduling: a request's last known token may not have reached the
        host; MTP drafts after it are placeholders too, filled by `MTPStep.draft`)."""
        if not self.async_scheduling:  # synchronous: every token is on the host
            return input_ids
        found = placeholder_positions(chunks, decodes)
        if found is not None:
            where, rows = found
            input_ids[self.upload(where)] = self.last_tokens[self.upload(rows)]
        return input_ids

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device, without blocking (`vlmrun.host_to_device.upload`)."""
        return upload(host, self.device)

    def embed_images(self, fb: ForwardBatch, chunks: list[ChunkInput], adapters: StepAdapters = NoAdapters(),
                     first_row: int = 0) -> None:
        """The vision stage: encode (or take from the encoder cache) the images the chunks feed and
        put their embeddings on `fb` for the model to splice in (the chunks' tokens start at `first_row`)."""
        if self.vision is None:
            return
        spans, row = [], first_row
        for i, c in enumerate(chunks):
            if c.mm_items:
                slot, tag = adapters.vision_adapter(i)  # LoRA: the tower's adapter, or none
                spans.append(ChunkSpan(list(c.mm_items), c.start, c.end, row, slot, tag))
            row += c.num_tokens
        vision = self.vision.prepare(spans, fb.num_tokens) if spans else None
        if vision is not None:
            fb.mm_mask, fb.mm_embeds, fb.mm_extras = vision.mm_mask, vision.mm_embeds, vision.mm_extras


def rows_per_sequence(bucketed_steps: Optional[BucketedStepRunner], fb: ForwardBatch) -> list[int]:
    """Each sequence's rows in the forward that runs `fb`: its tokens, or in a verify step run padded
    `width` rows (its tokens, then the padding of its row, which runs its adapter and is dropped).
    (A function, not a runner method: the LoRA binding holds it, and a bound method would make a
    reference cycle that keeps a dropped runner and its caches alive in the frozen startup heap.)"""
    if bucketed_steps is not None and fb.mode is not ForwardMode.DECODE and bucketed_steps.fits(fb):
        return [bucketed_steps.width] * fb.batch_size
    return fb.extend_seq_lens_cpu
