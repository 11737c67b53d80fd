"""Reasoning text apart from the answer: `<think>…</think>` (or `[THINK]…[/THINK]`) split
out of a stream of decoded text, however the markers fall across chunks. No I/O.

The marker pair is found in the tokenizer's vocabulary, never guessed from a model name.
Reasoning never reaches the content: a chunk that ends in what may be the start of a
marker is held back until the next chunk (or the end) says what it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from helexa.protocol.markers import MarkerPair, held_back


@dataclass(frozen=True, slots=True)
class ReasoningMarkers(MarkerPair):
    KNOWN = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt (a rendered template) leaves a reasoning block open, so the
        model's first words are reasoning."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


class ReasoningSplitter:
    """Feed decoded text as it comes; get (reasoning, content) deltas back."""

    def __init__(self, markers: ReasoningMarkers, *, in_reasoning: bool = False) -> None:
        self.markers = markers
        self.in_reasoning = in_reasoning
        self._pending = ""
        self._after_block = False  # strip the newlines a template puts after </think>

    def feed(self, text: str) -> tuple[str, str]:
        buffer = self._pending + text
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            marker = self.markers.end if self.in_reasoning else self.markers.start
            at = buffer.find(marker)
            if at < 0:
                keep = held_back(buffer, [marker])
                head, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
                self._emit(head, reasoning, content)
                break
            self._emit(buffer[:at], reasoning, content)
            buffer = buffer[at + len(marker) :]
            self._after_block = self.in_reasoning
            self.in_reasoning = not self.in_reasoning
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the stream: whatever was held back is text after all."""
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(self._pending, reasoning, content)
        self._pending = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self.in_reasoning:
            reasoning.append(text)
            return
        if self._after_block:
            text = text.lstrip("\n")
            if not text:
                return
            self._after_block = False
        content.append(text)


def split_reasoning(
    text: str, markers: ReasoningMarkers, *, in_reasoning: bool = False
) -> tuple[str, str]:
    """Reasoning and content of a whole answer."""
    splitter = ReasoningSplitter(markers, in_reasoning=in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
