"""Stop strings: found in a growing text fed piece by piece, and how much of it is safe to stream.

`StopStringMatcher` keeps one Knuth-Morris-Pratt automaton per stop string, so a piece costs
O(its length x stop strings) however long the text grows; `find_stop_string` / `safe_length` are its
whole-text forms. `vlmrun.engine.detokenizer.OutputTextStream` feeds it each token's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    start: int  # index of its first character in the text
    truncate_to: int  # the output text becomes text[:truncate_to]


class _StopAutomaton:
    """One stop string's Knuth-Morris-Pratt automaton.

    `matched` is the length of the longest suffix of the text fed so far that is a prefix of the
    stop string (its length: a full match). A character costs O(1) amortised, whatever the text's
    length; a stretch of text that cannot start a match is skipped by `str.find`.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.border = _borders(stop)
        self.matched = 0

    def feed(self, text: str) -> int:
        """Advance over `text`; return the index in `text` just past the first full match (-1: none)."""
        stop, border, k = self.stop, self.border, self.matched
        first_end = -1
        i = 0
        while i < len(text):
            if k == len(stop):
                k = border[k - 1]
            if k == 0:  # nothing under way: jump to the next possible start
                i = text.find(stop[0], i)
                if i < 0:
                    break
            ch = text[i]
            while k and stop[k] != ch:
                k = border[k - 1]
            if stop[k] == ch:
                k += 1
            i += 1
            if k == len(stop) and first_end < 0:
                first_end = i
        self.matched = k
        return first_end

    @property
    def partial(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of the stop string."""
        k = self.matched
        return self.border[k - 1] if k == len(self.stop) else k


def _borders(s: str) -> list[int]:
    """KMP failure function: border[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    border = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border


class StopStringMatcher:
    """Find stop strings in a growing text, fed piece by piece; say how much of it is safe to stream.

    Each `feed` costs O(new characters x stop strings), never a rescan of older text: every stop
    string has an automaton that remembers how much of it the text's end already spells.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._automata = [_StopAutomaton(s) for s in self.stop]
        self.num_chars = 0  # characters fed so far

    def feed(self, new_text: str) -> Optional[StopMatch]:
        """Append `new_text`; return the earliest stop occurrence that ends inside it (None: none).

        Positions count from the start of all text fed. Earliest start wins; on a tie the one
        that ends first (the shorter) wins, as it would have completed first had the text
        arrived a character at a time.
        """
        base = self.num_chars
        self.num_chars += len(new_text)
        best: Optional[tuple[int, int, str]] = None  # (start, end, stop)
        for automaton in self._automata:
            end = automaton.feed(new_text)
            if end < 0:
                continue
            stop = automaton.stop
            cand = (base + end - len(stop), base + end, stop)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        start, end, stop = best
        return StopMatch(stop=stop, start=start, truncate_to=end if self.include_stop_str_in_output else start)

    @property
    def held_chars(self) -> int:
        """How many characters at the end of the text must not be streamed yet.

        The longest tail that is a proper prefix of some stop string could still become one.
        Nothing is held back with `include_stop_str_in_output`: a later match then cuts after
        the stop string, which never removes text already streamed.
        """
        if self.include_stop_str_in_output:
            return 0
        return max((a.partial for a in self._automata), default=0)


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> Optional[StopMatch]:
    """The earliest stop occurrence ending inside the last `num_new_chars` chars of `text`."""
    old = len(text) - min(max(num_new_chars, 0), len(text))
    matcher = StopStringMatcher(stop, include_stop_str_in_output)
    matcher.feed(text[:old])
    return matcher.feed(text[old:]) if old < len(text) else None


def safe_length(text: str, stop: Sequence[str], include_stop_str_in_output: bool = False) -> int:
    """Length of the prefix of `text` that no stop string can still claim (see `held_chars`)."""
    matcher = StopStringMatcher(stop, include_stop_str_in_output)
    matcher.feed(text)
    return len(text) - matcher.held_chars
