"""The state machine both streamed translations share: an answer is a row of blocks (text,
reasoning, a tool call), one open at a time. Text of the open block's kind grows it; text
of another kind closes it and opens a block of that kind. Subclasses say what opening,
growing and closing emit: Anthropic's content blocks (protocol/anthropic_out.py), the
Responses API's output items (node/responses_out.py). No I/O."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

E = TypeVar("E")  # one event of the API's stream


class OneBlockOpen(Generic[E]):
    def __init__(self) -> None:
        self.open_kind: str | None = None  # the kind of the block open now, if any

    def grow(self, kind: str, text: str) -> list[E]:
        """Add `text` to a block of `kind`, opening one (and closing another) if need be."""
        events = self.open(kind) if self.open_kind != kind else []
        return [*events, *self._grown(kind, text)]

    def open(self, kind: str, fields: dict[str, Any] | None = None) -> list[E]:
        """Close the open block, if any, and open a new one of `kind`."""
        events = self.close()
        self.open_kind = kind
        return [*events, *self._opened(kind, fields)]

    def close(self) -> list[E]:
        """Close the open block, if any."""
        if self.open_kind is None:
            return []
        kind, self.open_kind = self.open_kind, None
        return self._closed(kind)

    def _opened(self, kind: str, fields: dict[str, Any] | None) -> list[E]:
        raise NotImplementedError

    def _grown(self, kind: str, text: str) -> list[E]:
        raise NotImplementedError

    def _closed(self, kind: str) -> list[E]:
        raise NotImplementedError
