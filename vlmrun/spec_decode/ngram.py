"""Prompt-lookup (n-gram) drafts: the tokens that followed the last time the request's latest n
tokens occurred in its own prompt and output.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked up in the
earlier tokens; at the latest earlier occurrence of the longest n that has one, the up-to-k tokens
that followed it are the draft. No occurrence: no draft (the request decodes one token). On the
host, with numpy: O(length x n) per lookup.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    drafts_on_device = False  # the drafts are real token ids, on the host

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
        tokens = np.asarray(token_ids, dtype=np.int64)
        earlier = tokens[:-1]  # an occurrence must end before the last token, so something follows it
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = sliding_window_view(earlier, n)  # [length - n, n]: every n-gram that has a successor
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
