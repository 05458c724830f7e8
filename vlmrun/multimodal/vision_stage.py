"""The vision stage of a step: encode the images its chunks need, splice rows into the token stream.

Images are looked up in the encoder cache by content hash; the missing ones are encoded in one
batched call. Under tensor parallelism with `mm_encoder_tp_mode="data"` (`split_over`), every rank
holds the same cache, finds the same images missing, encodes every `size`-th of them (rank r: the
r-th, r+size-th, ...) and gathers the others' embeddings, so each rank caches them all. A chunk that covers part of an image's token span takes the matching slice of that
image's embedding, so an image split across prefill chunks is encoded once. With LoRA, an image of a
request whose adapter changes the vision tower is encoded with that adapter's slot bound and cached
under its hash and the adapter's tag (`ChunkSpan.cache_tag`); other requests share the base embeddings.
Nothing here waits for the device: pixels and the token mask go up with `upload` (pinned, non-blocking),
and the image grids stay on the host, where the tower plans its segments and positions from them.

Once a chunk reaches the end of an image's token span, the image is consumed: its embedding is
pinned in the encoder cache for as long as the image item lives (a preemption by recompute, or the
same item in another request, finds it there) and the item's pixels are dropped, so a request in
decode holds no pixels. Where the pins would overflow the cache's capacity, the item keeps its
pixels, as before (`EncoderCache.pin`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vlmrun.cache.encoder_cache import EncoderCache, ImageEmbedding
from vlmrun.host_to_device import upload
from vlmrun.parallel import TensorParallel


@dataclass
class ChunkSpan:
    """A slice [start, end) of one request's tokens, fed at rows [row_offset, ...) of the batch."""
    mm_items: list  # processors.MMItem of the request
    start: int
    end: int
    row_offset: int
    lora_slot: int = -1  # LoRA: the adapter slot its images are encoded with (-1: the base tower)
    cache_tag: str = ""  # LoRA: keys its images apart in the encoder cache when its adapter changes the tower


@dataclass
class VisionInputs:
    mm_mask: torch.Tensor  # [num_tokens] bool
    mm_embeds: torch.Tensor  # [num_mm_tokens, hidden]
    mm_extras: dict[str, torch.Tensor]  # the model's extras (`VisionEmbeddings.extras`), each [..., num_mm_tokens, d]


class VisionStage:
    def __init__(self, model: nn.Module, cache: EncoderCache, device: torch.device, dtype: torch.dtype,
                 split_over: Optional[TensorParallel] = None, lora: Optional[Any] = None):
        self.model = model
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.split_over = split_over  # ranks that share the encoding of each step's images (data parallel)
        self.lora = lora  # LoRA (`vlmrun.lora.manager.LoRAManager`): binds an adapter slot for each encoder call

    def prepare(self, spans: list[ChunkSpan], num_tokens: int) -> Optional[VisionInputs]:
        pieces = [(item, max(s.start, item.offset), min(s.end, item.offset + item.length), s)
                  for s in spans for item in s.mm_items
                  if item.offset < s.end and item.offset + item.length > s.start]
        if not pieces:
            return None
        embeddings = self._embeddings_for([(item.hash + s.cache_tag, item, s.lora_slot) for item, _, _, s in pieces])
        for item, _, hi, span in pieces:
            if hi == item.offset + item.length:
                self._release_pixels(item, item.hash + span.cache_tag, embeddings[item.hash + span.cache_tag])
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        embeds: list[torch.Tensor] = []
        extras: dict[str, list[torch.Tensor]] = {}
        for item, lo, hi, span in pieces:  # spans and items come in token order, so rows do too
            mask[span.row_offset + lo - span.start: span.row_offset + hi - span.start] = True
            entry = embeddings[item.hash + span.cache_tag]
            embeds.append(entry.embeds[lo - item.offset: hi - item.offset])
            for name, extra in entry.extras.items():  # [..., length, d]: rows on the second-to-last dim
                extras.setdefault(name, []).append(extra[..., lo - item.offset: hi - item.offset, :])
        return VisionInputs(
            mm_mask=upload(mask, self.device),
            mm_embeds=torch.cat(embeds),
            mm_extras={name: torch.cat(parts, dim=-2) for name, parts in extras.items()},
        )

    def _release_pixels(self, item: Any, key: str, entry: ImageEmbedding) -> None:
        """A consumed image: its embedding pinned while `item` lives, its pixels dropped (if the pin fits)."""
        if item.pixel_values is None or not self.cache.pin(key, entry):
            return
        weakref.finalize(item, self.cache.unpin_later, key)  # wherever the item's last reference goes
        item.pixel_values = None

    def _embeddings_for(self, keyed: list[tuple[str, Any, int]]) -> dict[str, ImageEmbedding]:
        """(cache key, item, adapter slot) -> embeddings by key: cached, or encoded (one call per slot)."""
        found: dict[str, ImageEmbedding] = {}
        missing: dict[int, dict[str, Any]] = {}  # slot -> key -> item
        for key, item, slot in keyed:
            entry = self.cache.get(key) if key not in found else found[key]
            if entry is None:
                missing.setdefault(slot, {})[key] = item
            else:
                found[key] = entry
        for slot, items in missing.items():
            gone = [key for key, item in items.items() if item.pixel_values is None]
            if gone:  # cannot happen: an item without pixels keeps its pin while it lives
                raise RuntimeError(f"image {gone[0]} is neither in the encoder cache nor has pixels")
            found.update(self._encode(items, slot))
        return found

    @torch.no_grad()
    def _encode(self, items: dict[str, Any], slot: int = -1) -> dict[str, ImageEmbedding]:
        split = self.split_over is not None and self.split_over.size > 1
        if self.lora is not None:  # every patch of this call runs the slot's adapter (or none)
            self.lora.bind([slot], [1])
        outputs = self._encode_split(list(items.values())) if split else self._run_encoder(list(items.values()))
        result = {}
        for key, (e, extras) in zip(items, outputs):
            entry = ImageEmbedding(e, extras)
            self.cache.put(key, entry)
            result[key] = entry
        return result

    def _run_encoder(self, items: list) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """One batched encoder call -> per item (embeds [length, hidden], the model's extras [..., length, d])."""
        pixels = upload(torch.cat([it.pixel_values for it in items]), self.device).to(self.dtype)  # [patches, patch_dim]
        grid = [tuple(int(n) for n in it.grid_thw) for it in items]  # on the host, where the tower plans with it
        out = self.model.encode_images(pixels, grid)
        counts = [it.length for it in items]
        embeds = out.embeds.split(counts)
        extras = {name: extra.split(counts, dim=-2) for name, extra in out.extras.items()}
        return [(e, {name: parts[i] for name, parts in extras.items()}) for i, e in enumerate(embeds)]

    def _encode_split(self, items: list) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Rank r encodes items r, r + size, ...; every rank gets every item's embeddings."""
        tp = self.split_over
        mine = self._run_encoder(items[tp.rank::tp.size]) if items[tp.rank::tp.size] else []
        on_host = [(e.cpu(), {name: x.cpu() for name, x in extras.items()}) for e, extras in mine]
        gathered = tp.all_gather_object(on_host)  # [rank][i-th item of that rank's share]
        shares = [gathered[i % tp.size][i // tp.size] for i in range(len(items))]
        return [(e.to(self.device), {name: x.to(self.device) for name, x in extras.items()}) for e, extras in shares]
