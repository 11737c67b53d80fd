"""Marker pairs that fence parts of a model's output (`<think>…</think>`,
`<tool_call>…</tool_call>`), found in the tokenizer's vocabulary, never guessed from a
model's name. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Self


class Vocab(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class MarkerPair:
    start: str
    end: str

    KNOWN: ClassVar[tuple[tuple[str, str], ...]] = ()  # the pairs looked for, in order

    @classmethod
    def from_vocab(cls, tokenizer: Vocab) -> Self | None:
        """The first known pair whose both markers are tokens of this vocabulary, if any."""
        for start, end in cls.KNOWN:
            if tokenizer.token_to_id(start) is not None and tokenizer.token_to_id(end) is not None:
                return cls(start, end)
        return None


def held_back(text: str, stops: list[str]) -> int:
    """Chars at the end of `text` that might begin one of `stops` (not yet safe to emit).

    O(len(stop)²) per call: for short markers; a sequence's stop strings go through the
    engine's incremental `StopMatcher` instead."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold
