"""MTP drafts: the checkpoint's multi-token-prediction layer run beside the model (`MTPDrafter`).

Every step, after the model ran and sampled, the layer catches up over all the step's fed positions
(`catch_up`): position q gets the model's hidden state h_q and the token that follows q (the next
fed token, the next prompt token after a prompt chunk, or the token sampled at q), and writes its
own KV (one more KV-pool layer); its output at the last position whose next token the request
keeps is remembered per page-table row (`remember`, once the host knows how many drafts were
accepted). A verify step then drafts before the model runs (`draft`): draft 1 is the argmax of the
remembered output's logits; draft j + 1 runs the layer once more at the position after, on draft j's
embedding and the previous output (standing in for the model's hidden state there), writing KV at
the verify chunk's own slots. Drafts are greedy: a point mass, which the verify pass accepts by
`vlmrun/spec_decode/verify.py`'s rule.

What the layer writes only ever shapes the drafts, never the tokens a request gets (the verify
pass decides those), so two shortcuts change acceptance at most: a prompt position whose next token
is an image placeholder at the start of the next chunk takes the placeholder token's embedding (inside
a chunk it takes the image row's embedding, as the model saw it), and a prefix-cache hit reuses the
MTP KV of the hit's last position, computed with the next token of the request that cached it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.forward_batch import ForwardBatch
from vlmrun.host_to_device import upload
from vlmrun.layers.argmax import last_dim_argmax
from vlmrun.layers.attention.base import AttentionBackend
from vlmrun.layers.attention.hybrid_backend import full_attention
from vlmrun.layers.rotary import prepared_tables
from vlmrun.loader import iter_lazy_weights
from vlmrun.models.base import Model
from vlmrun.models.blocks.hybrid_decoder import HybridTextModel
from vlmrun.models.blocks.mtp import MultiTokenPredictor, mtp_checkpoint_name, num_mtp_layers
from vlmrun.models.weights import build_model, finish_loading, load_checkpoint
from vlmrun.parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)


@dataclass
class DraftingChunk:
    """What drafting needs of a speculating chunk: it feeds the request's last token and `num_drafts` drafts."""

    row: int  # page-table row
    start: int  # index of its first fed token (the last known one)
    num_drafts: int
    kv_slots: torch.Tensor  # [1 + num_drafts] int64 KV slots of its fed tokens (CPU)
    positions: torch.Tensor  # [3, 1 + num_drafts] int64 M-RoPE positions of its fed tokens (CPU)


class MTPDrafter:
    """The MTP layer beside `model`, and each page-table row's output to draft from next."""

    def __init__(self, model: Model, mtp: MultiTokenPredictor, num_rows: int):
        self.model = model
        self.mtp = mtp
        self.text = next(m for m in model.modules() if isinstance(m, HybridTextModel))
        weight = self.text.embed_tokens.weight
        # per page-table row: the layer's output at the request's last kept position (drafts start there)
        self.last_output = torch.zeros(num_rows + 1, weight.shape[1], dtype=weight.dtype, device=weight.device)

    # ------------------------------------------------------------------ after the model

    @torch.inference_mode()
    def catch_up(self, hidden: torch.Tensor, next_ids: torch.Tensor, fb: ForwardBatch,
                 backend: AttentionBackend, chunk_ends: Sequence[int]) -> torch.Tensor:
        """hidden [T, h] (the model's), next_ids [T] (the token after each fed position) -> the layer's
        output [T, h]; writes its KV at the step's slots. `chunk_ends`: each chunk's end row in the stream."""
        if fb.attn_metadata is None:  # the padded decode path prepared a copy of `fb` (or a cut batch)
            full_attention(backend).prepare(fb)  # (the layer has no GDN half: a verify step's GDN metadata stays)
        embeds = self.text.embed_tokens(next_ids)  # [T, h]
        if fb.mm_mask is not None:  # the next row's spliced image embedding, inside a chunk
            embeds = self._image_rows_shifted(embeds, fb, chunk_ends)
        cos, sin = prepared_tables(*self.text.rotary_emb(fb.positions))
        return self.mtp(embeds, hidden, cos, sin, fb)

    def _image_rows_shifted(self, embeds: torch.Tensor, fb: ForwardBatch, chunk_ends: Sequence[int]) -> torch.Tensor:
        seen = self.text.embed_tokens(fb.input_ids).masked_scatter(fb.mm_mask[:, None], fb.mm_embeds.to(embeds.dtype))
        last = torch.zeros_like(fb.mm_mask)
        last[upload(torch.tensor([end - 1 for end in chunk_ends]), last.device)] = True
        take = torch.zeros_like(fb.mm_mask)
        take[:-1] = fb.mm_mask[1:] & ~last[:-1]  # row q + 1 is an image row of the same chunk
        shifted = torch.cat([seen[1:], seen[:1]])  # row q holds row q + 1's embedding
        return torch.where(take[:, None], shifted, embeds)

    def remember(self, rows: torch.Tensor, outputs: torch.Tensor) -> None:
        """rows [n] page-table rows, outputs [n, h]: the layer's output at each row's last kept position."""
        self.last_output[rows] = outputs

    # ------------------------------------------------------------------ before a verify pass

    @torch.inference_mode()
    def draft(self, chunks: Sequence[DraftingChunk], backend: AttentionBackend, device: torch.device) -> torch.Tensor:
        """Drafts [n, max drafts] int64 for the speculating chunks (a chunk's tail past its own count is unused)."""
        rows = upload(torch.tensor([c.row for c in chunks], dtype=torch.int64), device)
        output = self.last_output[rows]  # [n, h]
        width = max(c.num_drafts for c in chunks)
        drafts = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
        drafts[:, 0] = last_dim_argmax(self.model.compute_logits(output))
        for j in range(1, width):  # drafts[:, j]: the layer at fed token j - 1, whose next token is drafts[:, j - 1]
            active = [i for i, c in enumerate(chunks) if c.num_drafts > j]
            fb = self._step_batch([chunks[i] for i in active], j - 1, backend, device)
            at = upload(torch.tensor(active, dtype=torch.int64), device)
            cos, sin = prepared_tables(*self.text.rotary_emb(fb.positions))
            out = self.mtp(self.text.embed_tokens(drafts[at, j - 1]), output[at], cos, sin, fb)  # [len(active), h]
            output[at] = out
            drafts[at, j] = last_dim_argmax(self.model.compute_logits(out))
        return drafts

    @staticmethod
    def _step_batch(chunks: Sequence[DraftingChunk], offset: int, backend: AttentionBackend,
                    device: torch.device) -> ForwardBatch:
        """One token per chunk: its fed token `offset`, at that token's KV slot and position, attending to
        every token before it (cached) and itself."""
        n = len(chunks)
        fb = ForwardBatch.build(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.stack([c.positions[:, offset] for c in chunks], dim=1),
            req_pool_indices=torch.tensor([c.row for c in chunks], dtype=torch.int64),
            extend_prefix_lens=[c.start + offset for c in chunks], extend_seq_lens=[1] * n,
            out_cache_loc=torch.stack([c.kv_slots[offset] for c in chunks]),
            logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
            to_device=lambda t: upload(t, device), attn_backend=full_attention(backend))
        fb.attn_backend.prepare(fb)
        return fb


def build_mtp_drafter(model: Model, config: EngineConfig, model_config: ModelConfig, num_rows: int,
                      device: torch.device, tp: TensorParallel = SINGLE) -> Optional[MTPDrafter]:
    """For `speculative_config` method "mtp": the checkpoint's MTP layer built and loaded beside `model`
    (its KV layer after the model's; a tensor-parallel rank's shard of it beside the rank's shard of the
    model); None for other methods. ValueError when the checkpoint has none."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    text = model_config.text_config
    if not any(isinstance(m, HybridTextModel) for m in model.modules()) or not num_mtp_layers(text):
        raise ValueError(f"speculative method 'mtp' needs a Qwen3.5 / Qwen3-Next checkpoint with MTP weights "
                         f"(mtp_num_hidden_layers > 0); {model_config.path} has none")
    if model_config.quantization is not None:
        raise ValueError("speculative method 'mtp' on a quantized checkpoint is not supported yet")
    kv_layer = model.cache_shape().num_attention_layers
    mtp = build_model(lambda cfg, shard: MultiTokenPredictor(cfg, lambda i: model.make_mlp(cfg, i), kv_layer, shard),
                      text, model_config.dtype, device, tp)
    load_checkpoint(mtp, iter_lazy_weights(model_config.path), mtp_checkpoint_name)
    finish_loading(mtp)
    logger.info("MTP drafter: the checkpoint's first MTP layer, KV-pool layer %d", kv_layer)
    return MTPDrafter(model, mtp.eval(), num_rows)


def with_mtp_layer(shape: CacheShape) -> CacheShape:
    """The caches of a model whose MTP layer drafts: one more full-attention KV layer."""
    return dataclasses.replace(shape, num_attention_layers=shape.num_attention_layers + 1)
