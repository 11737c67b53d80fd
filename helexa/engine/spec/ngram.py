"""Prompt lookup (vLLM's "ngram" method): the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, for the longest n from `max_n` down to `min_n`
that occurs earlier. No weights, no device: a scan of the token ids on the host."""

from __future__ import annotations


def propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens continuing `tokens` as they went on after the latest earlier match
    of their last n tokens (the longest n in [min_n, max_n] with one); [] when none."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n :]
        first = tail[0]
        # the latest start i < size - n with tokens[i : i + n] == tail
        i = size - n - 1
        while i >= 0:
            if tokens[i] == first and tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
            i -= 1
    return []


class NgramIndex:
    """`propose` kept incremental for one sequence: every n-gram (min_n..max_n tokens) that
    ends before the last token, by its latest start, updated with the tokens appended since
    the last call. A step costs a few dict operations, not a scan of a long prompt."""

    __slots__ = ("_end", "_latest", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._latest: dict[tuple[int, ...], int] = {}
        self._end = 0  # n-grams ending before this index are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """What `propose(tokens, k, min_n, max_n)` returns (tokens only ever grow)."""
        size = len(tokens)
        latest = self._latest
        for end in range(self._end, size - 1):  # n-grams ending at `end`, the last excluded
            for n in range(self.min_n, self.max_n + 1):
                start = end - n + 1
                if start < 0:
                    break
                latest[tuple(tokens[start : end + 1])] = start
        self._end = max(self._end, size - 1)
        if k < 1:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = latest.get(tuple(tokens[size - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []
