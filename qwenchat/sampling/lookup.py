"""Prompt lookup: proposes the tokens that followed the context's tail where it last occurred.

The longest recent n-gram of the context (up to `max_ngram` tokens, down to `min_ngram`) is
looked up among its earlier occurrences; the tokens that followed the latest of them are the
proposal. It needs no second model and pays where replies quote their context (a diff to fix,
a file to edit, code read back). An index of every n-gram's last two end positions keeps a
proposal O(max_ngram) whatever the context's length; the index grows as tokens are appended.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """The proposer's state for one token sequence: `reset` it, `extend` it as tokens are
    accepted, and ask `propose(k)` for up to k tokens."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> (the end of its occurrence before the last, the end of its last), where
        # an end is the index just past the n-gram; -1: none.
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}

    def reset(self, tokens: Sequence[int] = ()) -> None:
        """Forget everything and index `tokens`."""
        self.tokens = []
        self._ends = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(self.tokens[end - n:end])
                self._ends[key] = (self._ends.get(key, (-1, -1))[1], end)

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the longest tail n-gram
        that occurred before, continued through the proposal where that occurrence is less
        than k tokens back (a repeating pattern goes on repeating); none: an empty list."""
        end = len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            earlier, last = self._ends.get(tuple(self.tokens[end - n:end]), (-1, -1))
            at = last if last < end else earlier  # (the tail itself ends at `end`)
            if at > 0:  # (a periodic tail continues its period into the proposal itself)
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(self.tokens[i] if i < end else out[i - end])
                return out
        return []
