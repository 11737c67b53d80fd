"""UTF-8-safe incremental detokenization and stop-string handling for one sequence."""

from __future__ import annotations

from helexa.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding `ids[prefix:]` and `ids[prefix:read]` and taking the difference keeps
    leading-space handling right; a delta ending in U+FFFD means a multi-byte character
    is split across tokens, so it is held back until the next token completes it.
    """

    __slots__ = ("_prefix", "_read", "skip_special_tokens", "tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, start: int = 0
    ) -> None:
        """`start`: where the text begins in the ids `step` is given (after the prompt)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._prefix = start
        self._read = start

    def step(self, ids: list[int], final: bool = False) -> str:
        """New text made available by the ids appended since the last call; `final`
        also releases a dangling partial character at the end of generation."""
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(
            ids[self._prefix : self._read], skip_special_tokens=skip
        )
        full_text = self.tokenizer.decode(ids[self._prefix :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Stop strings found in text fed a piece at a time, for one sequence.

    Each stop string keeps a KMP state: the length of the longest suffix of the text so
    far that is a proper prefix of it. Feeding n new chars costs O(n) amortized per stop
    (O(n × stop length) at worst), whatever the length of the output, and the state also
    answers how much text to hold back. The failure table is extended lazily, never past
    the longest state reached, so a long stop string costs nothing until text matches it.
    """

    __slots__ = ("_failures", "_states", "stops")

    def __init__(self, stops: list[str]) -> None:
        assert all(stops), "empty stop strings are dropped by SamplingParams"
        self.stops = stops
        self._states = [0] * len(stops)
        self._failures: list[list[int]] = [[] for _ in stops]  # KMP prefix function, so far

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; the earliest stop string that ends in it, as (where it
        starts relative to the start of `text`, negative when it began earlier; the stop),
        or None. On a tie the stop listed first wins."""
        best: tuple[int, str] | None = None
        for i, stop in enumerate(self.stops):
            self._states[i], end = _advance(stop, self._failures[i], self._states[i], text)
            if end >= 0 and (best is None or end - len(stop) + 1 < best[0]):
                best = (end - len(stop) + 1, stop)
        return best

    @property
    def num_held(self) -> int:
        """Chars at the end of the text so far that might begin a stop string."""
        return max(self._states, default=0)


def _advance(stop: str, failure: list[int], state: int, text: str) -> tuple[int, int]:
    """KMP over `text` from `state`: (the new state, index in `text` where the first match
    ends or -1). `failure` is extended as the state reaches new lengths."""
    first_end = -1
    i, n, m = 0, len(text), len(stop)
    while i < n:
        if state == 0:  # nothing partly matched: skip to the stop's first char in C
            i = text.find(stop[0], i)
            if i < 0:
                break
        ch = text[i]
        while state and stop[state] != ch:
            state = failure[state - 1]
        if stop[state] == ch:
            state += 1
            if state > len(failure):
                _extend_failure(stop, failure)
            if state == m:
                if first_end < 0:
                    first_end = i
                state = failure[m - 1]
        i += 1
    return state, first_end


def _extend_failure(stop: str, failure: list[int]) -> None:
    """Append the next entry of the KMP prefix function of `stop`: the length of the
    longest proper border of stop[: len(failure) + 1]."""
    i = len(failure)
    k = failure[i - 1] if i else 0
    while k and stop[i] != stop[k]:
        k = failure[k - 1]
    if i and stop[i] == stop[k]:
        k += 1
    failure.append(k)
