"""Prompt-lookup (n-gram) drafts: the tokens that followed the last time the request's latest n
tokens occurred in its own prompt and output.

The longest n from `prompt_lookup_max` down to `prompt_lookup_min` wins; among occurrences of that
length, the latest. Up to k tokens that followed it are the draft (fewer when the occurrence is near
the end). No occurrence of at least `prompt_lookup_min` tokens: no draft (the request decodes one
token). On the host, one backward scan over the tokens: O(length x n).
"""

from __future__ import annotations

from typing import Sequence


class NgramProposer:
    drafts_on_device = False  # the drafts are real token ids, on the host
    drafts_grammar_rows = True  # a request with a grammar gets them (masked after each by its grammar)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) draft tokens to follow `token_ids` (the prompt and output so far)."""
        k = min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
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
        if best_len < self.min_n:
            return []
        return list(token_ids[best_end + 1:best_end + 1 + k])
