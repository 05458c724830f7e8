"""Prompt-lookup (n-gram) drafts: the tokens that followed the last time the request's latest n
tokens occurred in its own prompt and output.

The longest n from `prompt_lookup_max` down to `prompt_lookup_min` wins; among occurrences of that
length, the latest. Up to k tokens that followed it are the draft (fewer when the occurrence is near
the end). No occurrence of at least `prompt_lookup_min` tokens: no draft (the request decodes one
token).

With a request key (`propose(..., key=request_id)`, one key per request: `forget` it when the request
finishes) each request keeps an index (`NgramIndex`),
extended by the tokens appended since its last draft: every position where a `prompt_lookup_min`-gram
ends is chained to that n-gram's previous end (a hash chain, as LZ77 coders keep), so a draft visits
only the earlier occurrences of the request's last `prompt_lookup_min` tokens, latest first, and stops
at the first of `prompt_lookup_max`: no scan over the whole sequence per step. Without a key, one
backward scan over the tokens (O(length x n)); both give the same drafts.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Hashable, Optional, Sequence

KEPT_INDEXES = 1024  # request indexes kept (least recently drafted dropped first: finished requests age out)
CHECKED_POSITIONS = 16  # indexed tokens compared to tell that a call continues a request's tokens


class NgramIndex:
    """One request's tokens so far and, for each position p where a `min_n`-gram ends that a later token
    follows, the previous end of the same `min_n`-gram (`prev[p]`, -1: none) and its latest end (`head`)."""

    def __init__(self, min_n: int):
        self.min_n = min_n
        self.tokens: list[int] = []  # the tokens indexed from (to check a call continues them)
        self.head: dict[Hashable, int] = {}  # min_n-gram -> its latest indexed end
        self.prev = array("i")  # [positions indexed] the previous end of the n-gram ending there (-1: none)

    def continues(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` continues the tokens indexed so far (a request only appends): no shorter, and
        equal at the last indexed token and at `CHECKED_POSITIONS` spread over the rest. Constant time (a
        full comparison would cost what the scan did); it tells a key reused by another request, and a
        draft only proposes: the verify step decides the tokens."""
        n = len(self.tokens)
        if len(token_ids) < n:
            return False
        stride = max(1, n // CHECKED_POSITIONS)
        return all(token_ids[i] == self.tokens[i] for i in (*range(0, n, stride), n - 1) if i >= 0)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index every position a later token follows: up to len(token_ids) - 2."""
        start = len(self.prev)
        self.tokens.extend(token_ids[len(self.tokens):])
        tokens, m, head, prev = self.tokens, self.min_n, self.head, self.prev
        for end in range(start, len(tokens) - 1):
            key = tokens[end] if m == 1 else tuple(tokens[end - m + 1:end + 1]) if end >= m - 1 else None
            if key is None:
                prev.append(-1)
                continue
            prev.append(head.get(key, -1))
            head[key] = end

    def latest_longest(self, max_n: int) -> tuple[int, int]:
        """(n, end) of the latest earlier occurrence of the longest suffix (min_n <= n <= max_n) of the indexed
        tokens: the one that ends at `end`; (0, -1) when none."""
        tokens, m = self.tokens, self.min_n
        length = len(tokens)
        if length <= m:
            return 0, -1
        key = tokens[-1] if m == 1 else tuple(tokens[length - m:])
        best_len, best_end = 0, -1
        end = self.head.get(key, -1)
        while end >= 0:  # latest first; the first of the longest is the latest
            n = m
            while n < max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_len:
                best_len, best_end = n, end
                if n == max_n:
                    break
            end = self.prev[end]
        return best_len, best_end


class NgramProposer:
    drafts_on_device = False  # the drafts are real token ids, on the host
    drafts_grammar_rows = True  # a request with a grammar gets them (masked after each by its grammar)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 kept_indexes: int = KEPT_INDEXES):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.kept_indexes = kept_indexes
        self.indexes: OrderedDict[Hashable, NgramIndex] = OrderedDict()  # request key -> its index, LRU

    def propose(self, token_ids: Sequence[int], max_drafts: int, key: Optional[Hashable] = None) -> list[int]:
        """At most min(k, max_drafts) draft tokens to follow `token_ids` (the prompt and output so far). `key`
        (the request's id): keep the request's index between calls and extend it (see the module)."""
        k = min(self.k, max_drafts)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        if key is None:
            best_len, best_end = self._scan(token_ids)
        elif not isinstance(token_ids, list):
            return self.propose(list(token_ids), max_drafts, key)
        else:
            index = self._index(key, token_ids)
            best_len, best_end = index.latest_longest(self.max_n)
        if best_len < self.min_n:
            return []
        return list(token_ids[best_end + 1:best_end + 1 + k])

    def forget(self, key: Hashable) -> None:
        """Drop a request's index (it finished); an index not dropped ages out (`kept_indexes`)."""
        self.indexes.pop(key, None)

    def _index(self, key: Hashable, token_ids: Sequence[int]) -> NgramIndex:
        index = self.indexes.get(key)
        if index is None or not index.continues(token_ids):  # new, or the key reused by another request
            index = NgramIndex(self.min_n)
        self.indexes[key] = index
        self.indexes.move_to_end(key)
        while len(self.indexes) > self.kept_indexes:
            self.indexes.popitem(last=False)
        index.extend(token_ids)
        return index

    def _scan(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """One backward scan: (n, end) of the latest earlier occurrence of the longest suffix, (0, -1): none."""
        length = len(token_ids)
        last = token_ids[-1]
        best_len, best_end = 0, -1
        for end in range(length - 2, -1, -1):  # an earlier occurrence ending at `end`: token end + 1 follows it
            if token_ids[end] != last:
                continue
            n = 1
            while n < self.max_n and n <= end and token_ids[end - n] == token_ids[length - 1 - n]:
                n += 1
            if n > best_len:  # scanning back from the end: the first of the longest is the latest
                best_len, best_end = n, end
                if n == self.max_n:
                    break
        return best_len, best_end
