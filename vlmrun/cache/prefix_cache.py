"""Prefix cache over the paged KV pool: hashed full pages, chained from the parent page's key.

A prompt's full pages get keys `key[j] = H(key[j-1], token ids of page j, images in page j)`,
where "images in page j" lists, for every image whose tokens overlap the page, its content hash,
its grid and the slice [lo, hi) of its tokens the page covers. A key therefore names the whole
prefix up to the end of its page, pixels included: equal token ids with different images never
share a key. The KV of a page depends only on that prefix (token ids, pixels and the M-RoPE
positions, which are a function of both), so a page found by key can be reused as is.
The chain starts from a salt: a LoRA adapter's name, and a prompt's `cache_salt` (vLLM's field: a
tenant's own salt), so the first page's key, and with it every later one, differs per salt, and a
prompt never hits pages computed under another salt or none (`prompt_page_keys`).

The cache maps key -> page. Pages are refcounted by the `PageAllocator`; a cached page that no
request holds stays in the allocator's LRU of evictable pages until a new allocation needs it, and
is then dropped from the cache (`on_evict`). Hybrid (GDN) models also need the GDN state at the
boundary where a hit ends: a `GDNSnapshotPool` keeps a bounded number of snapshots, each tied to
the page that ends at its boundary and dropped with it; a match is cut back to the longest
boundary that has a snapshot.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from vlmrun.cache.gdn_pool import GDNSnapshots
from vlmrun.cache.kv_pool import PageAllocator
from vlmrun.processors import ProcessedPrompt


def page_keys(token_ids: Sequence[int], mm_items: Sequence, page_size: int, num_pages: int,
              salt: bytes = b"") -> list[bytes]:
    """Chained keys of the first `num_pages` full pages of a prompt.

    mm_items: `processors.MMItem`s (hash, offset, length, grid_thw), in token order. `salt` starts the
    chain: what else the KV depends on (a LoRA adapter), so prompts run with different ones never share.
    """
    keys: list[bytes] = []
    parent = salt
    items = sorted(mm_items, key=lambda it: it.offset)
    first = 0  # first item that may still overlap the current page
    for j in range(num_pages):
        lo, hi = j * page_size, (j + 1) * page_size
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"t")
        h.update(b",".join(str(t).encode() for t in token_ids[lo:hi]))
        while first < len(items) and items[first].offset + items[first].length <= lo:
            first += 1
        for it in items[first:]:
            if it.offset >= hi:
                break
            a, b = max(lo, it.offset) - it.offset, min(hi, it.offset + it.length) - it.offset
            h.update(f"|i{it.hash}:{tuple(it.grid_thw)}:{a}:{b}".encode())
        parent = h.digest()
        keys.append(parent)
    return keys


def prompt_page_keys(prompt: ProcessedPrompt, page_size: int, salt: bytes = b"") -> list[bytes]:
    """Keys of `prompt`'s full pages, the chain started from `salt` (an adapter's) and the prompt's
    `cache_salt` (None or "": no salt of its own)."""
    own = prompt.cache_salt
    if own:  # length-prefixed: no two (salt, cache_salt) pairs give the same bytes
        salt = b"%d:" % len(salt) + salt + b"|cache_salt:" + own.encode("utf-8", "surrogatepass")
    n = len(prompt.token_ids)
    return page_keys(prompt.token_ids, prompt.mm_items, page_size, n // page_size, salt)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # lookups (one per admission of a request, recomputes included)
    query_tokens: int = 0  # prompt tokens looked up
    hits: int = 0  # lookups that reused at least one page
    hit_tokens: int = 0  # prompt tokens whose KV was reused
    images_skipped: int = 0  # images wholly inside a hit: their vision encoding was not needed
    evicted_pages: int = 0
    cached_pages: int = 0  # pages currently indexed (in use or evictable)
    snapshots: int = 0  # GDN state snapshots currently kept (hybrid models)
    snapshots_taken: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class PrefixMatch:
    pages: list[int]  # cached pages, in token order (already referenced for the caller)
    snapshot: Optional[int]  # GDN snapshot index at the hit's end (hybrid models), else None

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class PrefixCache:
    """key -> page index over a refcounting `PageAllocator`, plus GDN snapshots for hybrid models."""

    def __init__(self, allocator: PageAllocator, snapshots: Optional[GDNSnapshots] = None,
                 needs_snapshots: bool = False):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.snapshots = snapshots
        self.needs_snapshots = needs_snapshots  # hybrid model: a hit must end at a snapshot
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # page -> snapshot index, LRU first
        self.stats = PrefixCacheStats()
        allocator.on_evict = self._evict

    # ------------------------------------------------------------------ lookups

    def match(self, keys: Sequence[bytes], max_pages: int) -> PrefixMatch:
        """The longest cached run of `keys[:max_pages]` (cut to a snapshot boundary when needed); referenced."""
        run: list[int] = []
        for key in keys[:max_pages]:
            page = self.page_of.get(key)
            if page is None:
                break
            run.append(page)
        snapshot = None
        if self.needs_snapshots:
            while run and run[-1] not in self.snapshot_of:
                run.pop()
            if run:
                snapshot = self.snapshot_of[run[-1]]
                self.snapshot_of.move_to_end(run[-1])
        self.allocator.share(run)
        return PrefixMatch(run, snapshot)

    def has_snapshot(self, key: bytes) -> bool:
        page = self.page_of.get(key)
        return page is not None and page in self.snapshot_of

    # ------------------------------------------------------------------ inserts

    def insert(self, key: bytes, page: int) -> bool:
        """Index a freshly computed full page; False when the key is already cached (another page)."""
        if key in self.page_of or page in self.key_of:
            return False
        self.page_of[key] = page
        self.key_of[page] = key
        self.allocator.mark_cached(page)
        self.stats.cached_pages += 1
        return True

    def save_snapshot(self, page: int, gdn_slot: int) -> None:
        """Keep the GDN state of `gdn_slot`, which is the state right after cached `page`."""
        if self.snapshots is None or page not in self.key_of:
            return
        if page in self.snapshot_of:
            self.snapshot_of.move_to_end(page)
            return
        idx = self.snapshots.alloc()
        if idx is None:  # pool full: drop the least recently used snapshot (its page stays cached)
            _, idx = self.snapshot_of.popitem(last=False)
            self.stats.snapshots -= 1
        self.snapshots.save(gdn_slot, idx)
        self.snapshot_of[page] = idx
        self.stats.snapshots += 1
        self.stats.snapshots_taken += 1

    def restore_snapshot(self, snapshot: int, gdn_slot: int) -> None:
        assert self.snapshots is not None
        self.snapshots.restore(snapshot, gdn_slot)

    # ------------------------------------------------------------------ eviction

    def reset(self) -> int:
        """Forget every cached page no request holds (vLLM's reset_prefix_cache): they become free pages and
        their GDN snapshots go with them. Returns how many pages were forgotten."""
        return len(self.allocator.evict_all())

    def _evict(self, page: int) -> None:
        key = self.key_of.pop(page, None)
        if key is None:
            return
        del self.page_of[key]
        self.stats.cached_pages -= 1
        self.stats.evicted_pages += 1
        idx = self.snapshot_of.pop(page, None)
        if idx is not None and self.snapshots is not None:
            self.snapshots.free(idx)
            self.stats.snapshots -= 1
