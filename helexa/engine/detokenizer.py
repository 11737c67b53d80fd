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

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._prefix = 0
        self._read = 0

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


def find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `start`: (index, stop) or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Chars at the end of `text` that might begin a stop string (not yet safe to emit)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold
