"""n-gram drafts from a request's kept index (`NgramProposer.propose(..., key=...)`, `NgramIndex`): the
same drafts as the backward scan and as the rule's definition while a request's tokens grow step by
step, a key reused by another request, indexes aged out, and no scan over the whole sequence."""

from __future__ import annotations

import random

from tests.test_spec_decode import brute_force_drafts
from vlmrun.spec_decode.ngram import NgramIndex, NgramProposer


def test_kept_index_equals_the_scan_as_tokens_grow():
    rng = random.Random(0)
    for trial in range(300):
        k, low = rng.randrange(1, 5), rng.randrange(1, 4)
        high = low + rng.randrange(0, 3)
        proposer = NgramProposer(k, low, high)
        alphabet = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 12))]
        for _ in range(rng.randrange(1, 25)):
            want = brute_force_drafts(tokens, k, low, high)
            assert proposer.propose(tokens, 9) == want, tokens  # the scan
            assert proposer.propose(list(tokens), 9, key=trial % 3) == want, tokens  # the index (3 live keys)
            tokens += [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]  # accepted drafts + 1


def test_a_reused_key_starts_a_new_index():
    proposer = NgramProposer(2, 1, 2)
    assert proposer.propose([1, 2, 3, 1], 5, key="r") == [2, 3]
    assert proposer.propose([5, 6, 7, 5], 5, key="r") == [6, 7]  # another request under the same id
    assert proposer.propose([5, 6], 5, key="r") == []  # shorter than what was indexed: not a continuation
    assert proposer.propose((5, 6, 5), 5, key="r") == [6, 5]  # any sequence


def test_indexes_age_out_and_are_forgotten():
    proposer = NgramProposer(2, 1, 2, kept_indexes=2)
    for key in "abc":
        proposer.propose([1, 2, 1], 5, key=key)
    assert list(proposer.indexes) == ["b", "c"]
    proposer.forget("b")
    assert list(proposer.indexes) == ["c"]


def test_a_draft_visits_only_the_occurrences_of_the_last_tokens():
    """A long prompt where the last token occurs twice: the lookup follows that chain only (two steps), it
    does not walk the sequence back; the index is extended by the appended tokens alone."""
    index = NgramIndex(min_n=1)
    tokens = list(range(100, 5100)) + [7, 8, 9, 7]
    index.extend(tokens)
    assert index.latest_longest(3) == (1, 5000)
    tokens += [8]
    index.extend(tokens)  # the one new position a later token follows
    assert len(index.prev) == len(tokens) - 1
    visited = []
    prev = index.prev

    class Recording:
        def __getitem__(self, i: int) -> int:
            visited.append(i)
            return prev[i]

    index.prev = Recording()
    assert index.latest_longest(3) == (2, 5001)
    assert visited == [5001]  # the one earlier occurrence of 8, then the end of its chain
