"""One assistant answer as it streams: its decoded text split into reasoning, content and
tool calls, the way the OpenAI chat and Responses APIs carry them. No I/O.

Reasoning is split first (a `<tool_call>` inside reasoning is reasoning), then the content
is searched for tool calls. With `include_thinking` the reasoning is put back into the
content inside its own markers instead (the `x-include-thinking: true` contract).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from helexa.protocol.reasoning import ReasoningMarkers, ReasoningSplitter
from helexa.protocol.tool_calls import ParsedCall, Schemas, ToolCallMarkers, ToolCallSplitter


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    index: int  # position among this answer's calls
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends `function.arguments`


@dataclass(slots=True)
class Pieces:
    """What one delta of text added to the answer."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class AssistantOutput:
    """Feed decoded text (and how many tokens it was); get `Pieces` back.

    `hold_content` keeps plain text back until a tool call shows up (tool_choice
    "required" or a named function: an answer without the call is refused whole, so
    none of it may have been sent). `call_prefix`: the prompt ended inside a call's
    block with this text, so the answer continues that call."""

    def __init__(
        self,
        reasoning: ReasoningMarkers | None = None,
        tool_calls: ToolCallMarkers | None = None,
        schemas: Schemas | None = None,
        *,
        in_reasoning: bool = False,
        include_thinking: bool = False,
        hold_content: bool = False,
        call_prefix: str | None = None,
    ) -> None:
        self._reasoning = (
            ReasoningSplitter(reasoning, in_reasoning=in_reasoning) if reasoning else None
        )
        self._markers = reasoning
        self._tools = (
            ToolCallSplitter(tool_calls, schemas or {}, call_prefix=call_prefix)
            if tool_calls
            else None
        )
        self.include_thinking = include_thinking
        self.hold_content = hold_content
        self._held: list[str] = []
        self._wrapped_open = False  # include_thinking: the start marker is in the content
        # the whole answer so far
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []
        self.calls: list[ToolCallOut] = []
        self.num_reasoning_tokens = 0

    @property
    def in_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.in_reasoning

    def feed(self, text: str, num_tokens: int = 0) -> Pieces:
        was_reasoning = self.in_reasoning
        if self._reasoning is None:
            reasoning, content = "", text
        else:
            reasoning, content = self._reasoning.feed(text)
        if num_tokens and (was_reasoning or self.in_reasoning or (reasoning and not content)):
            self.num_reasoning_tokens += num_tokens
        return self._pieces(reasoning, content, final=False)

    def finish(self) -> Pieces:
        """The end of the answer: everything held back comes out."""
        reasoning, content = self._reasoning.flush() if self._reasoning else ("", "")
        return self._pieces(reasoning, content, final=True)

    def _pieces(self, reasoning: str, content: str, *, final: bool) -> Pieces:
        out = Pieces()
        if self.include_thinking and self._markers is not None:
            content = self._wrap(reasoning, final) + content
            reasoning = ""
        out.reasoning = reasoning
        if reasoning:
            self.reasoning_text.append(reasoning)
        parts: list[str | ParsedCall]
        if self._tools is None:
            parts = [content] if content else []
        else:
            parts = self._tools.feed(content) if content else []
            if final:
                parts += self._tools.flush()
        text: list[str] = []
        for part in parts:
            if isinstance(part, str):
                text.append(part)
                continue
            call = ToolCallOut(len(self.calls), new_call_id(), part.name, part.arguments_json)
            self.calls.append(call)
            out.calls.append(call)
        out.content = self._release("".join(text), final)
        if out.content:
            self.content_text.append(out.content)
        return out

    def _wrap(self, reasoning: str, final: bool) -> str:
        """include_thinking: reasoning back inline, inside its markers."""
        assert self._markers is not None
        head = ""
        if reasoning:
            if not self._wrapped_open:
                head, self._wrapped_open = self._markers.start, True
            head += reasoning
        if self._wrapped_open and (final or not self.in_reasoning):
            head += self._markers.end
            self._wrapped_open = False
        return head

    def _release(self, text: str, final: bool) -> str:
        if not self.hold_content:
            return text
        if text:
            self._held.append(text)
        if self.calls:  # with a call, the text before it is part of the answer
            text, self._held = "".join(self._held), []
            return text
        return ""

    @property
    def held_text(self) -> str:
        """hold_content: what the model said instead of calling a tool."""
        return "".join(self._held)

    # the whole answer
    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_text)

    @property
    def content(self) -> str:
        return "".join(self.content_text)
