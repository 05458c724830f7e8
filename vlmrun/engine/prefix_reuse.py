"""The scheduler's side of the prefix cache: what an admitted request takes, where chunks are cut, what is indexed.

`PrefixReuse` holds the engine's `PrefixCache` (docs/prefix_cache.md) and the rules the scheduler applies
with it: an admitted request takes the longest run of cached full prompt pages (always leaving at least
one token to compute; none for a request with prompt logprobs, vLLM's rule), restoring the GDN snapshot
of a hybrid model; a hybrid model's prefill chunks are cut at snapshot points (every `snapshot_interval`
tokens and the last full prompt page) whose snapshot is missing; after a step `commit` indexes the new
full prompt pages and saves the GDN snapshot at such a point. The scheduler holds one (`Scheduler.prefix`),
a cache or not: without a cache every method is a no-op.
"""

from __future__ import annotations

from typing import Optional

from vlmrun.cache.gdn_pool import gdn_slot_for_row
from vlmrun.cache.kv_pool import pages_needed
from vlmrun.cache.prefix_cache import PrefixCache, PrefixMatch
from vlmrun.engine.request import Request


class PrefixReuse:
    def __init__(self, prefix_cache: Optional[PrefixCache], page_size: int, snapshot_interval: int = 512):
        self.cache = prefix_cache
        self.page_size = page_size
        # hybrid models: snapshot points every this many tokens (a page multiple) and at the last full page
        self.snapshot_interval = pages_needed(snapshot_interval, page_size) * page_size
        self.cuts_at_snapshots = prefix_cache is not None and prefix_cache.needs_snapshots

    def take(self, req: Request, row: int) -> Optional[PrefixMatch]:
        """Take the cached prefix of a request being admitted (page-table row `row`); the match or None without a cache."""
        cache = self.cache
        # a request with prompt logprobs computes its whole prompt (vLLM's rule: no prefix-cache hit for it)
        if cache is None or req.num_computed_tokens or not req.page_keys or req.sampling_params.prompt_logprobs is not None:
            return None
        max_pages = min(len(req.page_keys), (req.num_tokens - 1) // self.page_size)  # leave >= 1 token
        match = cache.match(req.page_keys, max_pages)
        if not match.pages:
            return match
        n = match.num_pages * self.page_size
        req.pages = list(match.pages)
        req.num_computed_tokens = req.prefix_hit_tokens = n
        req.num_indexed_pages = match.num_pages
        if match.snapshot is not None:
            cache.restore_snapshot(match.snapshot, gdn_slot_for_row(row))
        return match

    def count_lookup(self, req: Request, hit_pages: int) -> None:
        """The cache's hit statistics, once the request that looked up is admitted."""
        stats = self.cache.stats
        hit = hit_pages * self.page_size
        stats.queries += 1
        stats.query_tokens += req.num_prompt_tokens
        stats.hits += hit > 0
        stats.hit_tokens += hit
        stats.images_skipped += sum(it.offset + it.length <= hit for it in req.prompt.mm_items)

    def cut(self, req: Request, n: int) -> int:
        """`n` tokens to feed from `req.num_computed_tokens`, cut back to a snapshot point whose snapshot
        is missing (hybrid models; unchanged otherwise)."""
        start = req.num_computed_tokens
        if not self.cuts_at_snapshots or start >= req.num_prompt_tokens:
            return n
        end = start + n
        limit = min(end, req.num_prompt_tokens)
        last_full = len(req.page_keys) * self.page_size
        points = [p for p in (last_full, limit // self.snapshot_interval * self.snapshot_interval)
                  if start < p <= limit]
        if not points:
            return n
        point = max(points)
        if point < end and not self.cache.has_snapshot(req.page_keys[point // self.page_size - 1]):
            return point - start
        return n

    def ends_at_snapshot_point(self, req: Request) -> bool:
        """A hybrid model's request whose computed tokens end at a snapshot point (its snapshot is taken at collect)."""
        return self.cuts_at_snapshots and self.is_snapshot_point(req, req.num_computed_tokens)

    def is_snapshot_point(self, req: Request, boundary: int) -> bool:
        if boundary <= 0 or boundary % self.page_size or boundary > len(req.page_keys) * self.page_size:
            return False
        return boundary == len(req.page_keys) * self.page_size or boundary % self.snapshot_interval == 0

    def commit(self, req: Request, end: int) -> None:
        """After a step computed `req` up to `end`: index its new full prompt pages, and snapshot its
        GDN state when the step ended at a snapshot point (hybrid models). (Under async scheduling a
        later step of `req` may already be launched; `Scheduler.must_wait` kept it from moving the GDN slot.)"""
        cache = self.cache
        if cache is None or not req.page_keys:
            return
        done = min(end // self.page_size, len(req.page_keys))
        for j in range(req.num_indexed_pages, done):
            cache.insert(req.page_keys[j], req.pages[j])
        req.num_indexed_pages = max(req.num_indexed_pages, done)
        if cache.snapshots is not None and self.is_snapshot_point(req, end):
            cache.save_snapshot(req.pages[end // self.page_size - 1], gdn_slot_for_row(req.req_pool_idx))
