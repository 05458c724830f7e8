"""The vision stage of a step: encode the images its chunks need, splice rows into the token stream.

Images are looked up in the encoder cache by content hash; the missing ones are encoded in one
batched call. Under tensor parallelism with `mm_encoder_tp_mode="data"` (`split_over`), every rank
holds the same cache, finds the same images missing, encodes every `size`-th of them (rank r: the
r-th, r+size-th, ...) and gathers the others' embeddings, so each rank caches them all. A chunk that covers part of an image's token span takes the matching slice of that
image's embedding, so an image split across prefill chunks is encoded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from vlmrun.cache.encoder_cache import EncoderCache, ImageEmbedding
from vlmrun.parallel import TensorParallel


@dataclass
class ChunkSpan:
    """A slice [start, end) of one request's tokens, fed at rows [row_offset, ...) of the batch."""
    mm_items: list  # processors.MMItem of the request
    start: int
    end: int
    row_offset: int


@dataclass
class VisionInputs:
    mm_mask: torch.Tensor  # [num_tokens] bool
    mm_embeds: torch.Tensor  # [num_mm_tokens, hidden]
    deepstack_embeds: Optional[torch.Tensor]  # [layers, num_mm_tokens, hidden]


class VisionStage:
    def __init__(self, model: nn.Module, cache: EncoderCache, device: torch.device, dtype: torch.dtype,
                 split_over: Optional[TensorParallel] = None):
        self.model = model
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.split_over = split_over  # ranks that share the encoding of each step's images (data parallel)

    def prepare(self, spans: list[ChunkSpan], num_tokens: int) -> Optional[VisionInputs]:
        pieces = [(item, max(s.start, item.offset), min(s.end, item.offset + item.length), s)
                  for s in spans for item in s.mm_items
                  if item.offset < s.end and item.offset + item.length > s.start]
        if not pieces:
            return None
        embeddings = self._embeddings_for([item for item, *_ in pieces])
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        embeds, deepstack = [], []
        for item, lo, hi, span in pieces:  # spans and items come in token order, so rows do too
            mask[span.row_offset + lo - span.start: span.row_offset + hi - span.start] = True
            entry = embeddings[item.hash]
            embeds.append(entry.embeds[lo - item.offset: hi - item.offset])
            if entry.deepstack is not None:
                deepstack.append(entry.deepstack[:, lo - item.offset: hi - item.offset])
        return VisionInputs(
            mm_mask=mask.to(self.device, non_blocking=True),
            mm_embeds=torch.cat(embeds),
            deepstack_embeds=torch.cat(deepstack, dim=1) if deepstack else None,
        )

    def _embeddings_for(self, items: list) -> dict[str, ImageEmbedding]:
        found: dict[str, ImageEmbedding] = {}
        missing = {}
        for item in items:
            entry = self.cache.get(item.hash) if item.hash not in found else found[item.hash]
            if entry is None:
                missing[item.hash] = item
            else:
                found[item.hash] = entry
        if missing:
            found.update(self._encode(list(missing.values())))
        return found

    @torch.no_grad()
    def _encode(self, items: list) -> dict[str, ImageEmbedding]:
        split = self.split_over is not None and self.split_over.size > 1
        outputs = self._encode_split(items) if split else self._run_encoder(items)
        result = {}
        for it, (e, d) in zip(items, outputs):
            entry = ImageEmbedding(e, d)
            self.cache.put(it.hash, entry)
            result[it.hash] = entry
        return result

    def _run_encoder(self, items: list) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """One batched encoder call -> per item (embeds [length, hidden], deepstack [k, length, hidden] | None)."""
        pixels = torch.cat([it.pixel_values for it in items]).to(self.device, self.dtype)  # [patches, patch_dim]
        grid = torch.tensor([list(it.grid_thw) for it in items], dtype=torch.int64, device=self.device)
        out = self.model.encode_images(pixels, grid)
        counts = [it.length for it in items]
        embeds = out.embeds.split(counts)
        deepstack = out.deepstack.split(counts, dim=1) if out.deepstack is not None else [None] * len(items)
        return list(zip(embeds, deepstack))

    def _encode_split(self, items: list) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Rank r encodes items r, r + size, ...; every rank gets every item's embeddings."""
        tp = self.split_over
        mine = self._run_encoder(items[tp.rank::tp.size]) if items[tp.rank::tp.size] else []
        on_host = [(e.cpu(), None if d is None else d.cpu()) for e, d in mine]
        gathered = tp.all_gather_object(on_host)  # [rank][i-th item of that rank's share]
        return [tuple(None if t is None else t.to(self.device) for t in gathered[i % tp.size][i // tp.size])
                for i in range(len(items))]
