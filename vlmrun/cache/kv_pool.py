"""Paged KV cache: the request-to-token map, the KV buffers and the page allocator.

A KV *slot* holds one token's keys and values for every full-attention layer. Slots are grouped
in pages of `page_size` consecutive slots; a request owns whole pages. `ReqToTokenPool` maps
(request row, token position) to the slot that holds that token. Page 0 is a dummy: padding rows
write there and nothing reads it.

The pool stores K/V in the model's dtype or, with `kv_cache_dtype` "fp8" (docs/kv_cache_dtype.md), in
float8 with one scale per layer for K and one for V (`k_scales`, `v_scales`; from the checkpoint, else
1.0): `write` stores k / k_scale, saturated to the format's range, and a backend reads k back as
stored * k_scale (`dequantize`).

`PageTable` is the map as its one writer, the scheduler, sees it: rows handed out and freed, and
`write`. `ReqToTokenPool` keeps the map on the device; under tensor parallelism the driver's
`ShadowReqToTokenPool` (cache/shadow.py) records the writes for the ranks instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Optional

import torch

from vlmrun.host_to_device import upload


class PageTable(ABC):
    """A row per running request, mapping its token positions to KV slots: the rows and the writes.

    One more row, `dummy_row` (= max_reqs), is never handed out nor written: it maps every position
    to slot 0 of the dummy page. Padded rows of a decode batch use it.
    """

    def __init__(self, max_reqs: int):
        self.free_rows: list[int] = list(range(max_reqs))
        self.max_reqs = max_reqs
        self.dummy_row = max_reqs

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def num_free(self) -> int:
        return len(self.free_rows)

    @abstractmethod
    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Map position positions[i] of row rows[i] to KV slot slots[i]; host tensors [n] int64."""


class ReqToTokenPool(PageTable):
    """The page table on the device: req_to_token[row, pos] is the KV slot of token `pos` of `row`.

    The dummy row stays all zeros.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device):
        super().__init__(max_reqs)
        self.req_to_token = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int64, device=device)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i], moved to the device in one copy each (no host sync);
        written flat (`index_copy_` at rows * width + positions: one kernel, no advanced-index assignment; a
        step's (row, position) pairs are distinct)."""
        table = self.req_to_token  # [rows, max_context_len]
        flat = upload(rows * table.shape[1] + positions, table.device)  # [n]
        table.view(-1).index_copy_(0, flat, upload(slots, table.device))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVPool:
    """Per full-attention layer: k and v buffers of [num_slots, num_kv_heads, head_dim] in `dtype` (the
    storage dtype: the model's `compute_dtype`, or a float8 one with per-layer scales)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1,
                 compute_dtype: Optional[torch.dtype] = None):
        if num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype  # what attention runs in (the model's dtype)
        self.k_scales = [1.0] * num_layers  # float8 storage: a stored k times its layer's scale is the k written
        self.v_scales = [1.0] * num_layers
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored in float8 (written scaled, read back `dequantize`d)."""
        return self.dtype in FP8_DTYPES

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Per-layer float8 scales (positive, finite: a ValueError naming the layer otherwise)."""
        if len(k_scales) != self.num_layers or len(v_scales) != self.num_layers:
            raise ValueError(f"KV scales for {len(k_scales)} / {len(v_scales)} layers; the pool has {self.num_layers}")
        for i, scale in enumerate(k_scales + v_scales):
            if not (0.0 < scale < float("inf")):
                raise ValueError(f"KV cache layer {i % self.num_layers}: scale {scale} is not a positive finite number")
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [num_tokens]; k, v: [num_tokens, num_kv_heads, head_dim]
        # index_copy_: quicker than `buffer[loc] = k` (advanced-index assignment); float8 ones copied as bytes
        if self.quantized:
            k, v = self._quantize(k, self.k_scales[layer_id]), self._quantize(v, self.v_scales[layer_id])
        self._as_stored(self.k_buffers[layer_id]).index_copy_(0, loc, self._as_stored(k.to(self.dtype)))
        self._as_stored(self.v_buffers[layer_id]).index_copy_(0, loc, self._as_stored(v.to(self.dtype)))

    def clear(self, layer_id: int, slots: torch.Tensor) -> None:
        """Zero a layer's k and v at `slots` [m] (int64, on the pool's device)."""
        for buffer in (self.k_buffers[layer_id], self.v_buffers[layer_id]):
            self._as_stored(buffer).index_fill_(0, slots, 0)  # (float8: zero bytes are 0.0)

    def _as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x itself, or a float8 tensor as its bytes (index_copy_ / index_fill_ take no float8 on the CPU)."""
        return x.view(torch.uint8) if self.quantized else x

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x / scale in float32, saturated to the float8 format's range (a cast alone may give NaN)."""
        limit = torch.finfo(self.dtype).max
        return (x.float() / scale).clamp_(-limit, limit).to(self.dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K or V gathered from the pool -> `dtype`, times the layer's scale (1.0: a plain cast; a copy may be
    the input itself when it is in `dtype` already)."""
    out = stored if stored.dtype == dtype else stored.to(dtype)
    return out if scale == 1.0 else out * scale


class PageAllocator:
    """Hands out pages of `page_size` slots, refcounted. Page 0 is reserved as the dummy page.

    A page has one reference per request holding it. A page the prefix cache indexes
    (`mark_cached`) is not freed when its last reference goes: it joins an LRU of evictable pages
    that `alloc` reclaims, oldest first, only when the free list runs short (`on_evict(page)` tells
    the prefix cache to forget it). Evictable pages count as free in `num_free_pages`.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: list[int] = list(range(num_pages - 1, 0, -1))  # pop() yields 1, 2, ...
        self.refcount: list[int] = [0] * num_pages
        self.cached: set[int] = set()  # pages the prefix cache indexes
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, LRU first
        self.on_evict: Optional[Callable[[int], None]] = None

    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached pages no request holds."""
        return len(self.free_pages) + len(self.evictable)

    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def num_evictable_pages(self) -> int:
        return len(self.evictable)

    def alloc(self, n: int) -> list[int] | None:
        if n > self.num_free_pages():
            return None
        while len(self.free_pages) < n:
            page, _ = self.evictable.popitem(last=False)
            self.cached.discard(page)
            if self.on_evict is not None:
                self.on_evict(page)
            self.free_pages.append(page)
        pages = [self.free_pages.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def evict_all(self) -> list[int]:
        """Free every evictable page (cached, held by no request), telling `on_evict` of each; the pages
        evicted (the prefix cache's reset)."""
        evicted = list(self.evictable)
        self.evictable.clear()
        for page in evicted:
            self.cached.discard(page)
            if self.on_evict is not None:
                self.on_evict(page)
            self.free_pages.append(page)
        return evicted

    def share(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (cached pages reused by a prefix hit)."""
        for p in pages:
            self.refcount[p] += 1
            self.evictable.pop(p, None)

    def mark_cached(self, page: int) -> None:
        self.cached.add(page)

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; the last one frees it (or makes a cached page evictable).

        Pages are released last first, so a prefix's deeper pages are evicted before its first ones.
        """
        for p in reversed(pages):
            self.refcount[p] -= 1
            if self.refcount[p] > 0:
                continue
            if p in self.cached:
                self.evictable[p] = None
            else:
                self.free_pages.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def token_slots(pages: list[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of token positions start..end-1 of a request holding `pages` in order (host ints:
    one `range` per page touched, cheaper than tensor ops for the one-token chunks of decode)."""
    slots: list[int] = []
    for page in range(start // page_size, (end - 1) // page_size + 1):
        offset = pages[page] * page_size - page * page_size  # slot of position p in this page: offset + p
        slots.extend(range(offset + max(start, page * page_size), offset + min(end, (page + 1) * page_size)))
    return slots
