"""Anthropic answers from the node's OpenAI ones: whole messages, the streaming event state
machine, and errors in Anthropic's shape. No I/O.

A stream is `message_start`, then per content block (`thinking`, `text`, `tool_use`, each
with its own index, in order) `content_block_start` / `content_block_delta`... /
`content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`. An
upstream that ends before its finish chunk, or sends an error, closes the open block and
ends with an `error` event instead, as Anthropic's own API does mid-stream.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from typing import Any

from helexa.protocol.anthropic import Translated
from helexa.protocol.blocks import OneBlockOpen

Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)
# helexa.errors.context_length_exceeded's wording
_CONTEXT = re.compile(
    r"maximum context length is (?P<max>\d+) tokens(?:; the prompt has (?P<prompt>\d+))?"
)

# HTTP status -> Anthropic error type (others: 4xx invalid_request_error, 5xx api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# An OpenAI envelope's code or type -> Anthropic error type, for errors inside a stream.
_OPENAI_ERRORS = {
    "rate_limit_exceeded": "rate_limit_error",
    "insufficient_quota": "rate_limit_error",
    "service_unavailable": "overloaded_error",
    "insufficient_vram": "overloaded_error",
    "recovering": "overloaded_error",
    "invalid_request_error": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
}


# --- whole answers --------------------------------------------------------------------------------


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(openai_id: object) -> str:
    """The node's call id when Anthropic's id pattern allows it, else a fresh `toolu_` one."""
    if (
        isinstance(openai_id, str)
        and openai_id
        and all(c.isalnum() or c in "_-" for c in openai_id)
    ):
        return openai_id
    return "toolu_" + uuid.uuid4().hex[:24]


def tool_input(arguments: object) -> dict[str, Any]:
    """A call's arguments (a JSON string or an object) as the tool_use `input` object."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}  # never dropped, even when the model botched it
    return value if isinstance(value, dict) else {"arguments": value}


def thinking_signature(thinking: str) -> str:
    """An opaque, stable signature for a thinking block (clients echo it back; unchecked)."""
    digest = hashlib.sha256(b"helexa-thinking\0" + thinking.encode()).digest()
    return base64.b64encode(digest).decode()


def stop_reason(
    finish_reason: object, matched: object, stop_sequences: list[str], has_tool_calls: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an OpenAI finish_reason; `matched` is the node's
    vLLM-style `stop_reason`: the stop string that ended the answer, if one did."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or has_tool_calls:
        return "tool_use", None
    if finish_reason == "content_filter":
        return "refusal", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(u: object) -> dict[str, int]:
    """Anthropic usage from OpenAI usage: the prompt tokens read from the prefix cache
    (`cached_tokens`) and those stored in it (`cache_write_tokens`) are counted apart, as
    Anthropic's input_tokens excludes both."""
    u = u if isinstance(u, dict) else {}
    prompt = _count(u.get("prompt_tokens"))
    details = _dict(u.get("prompt_tokens_details"))
    cached = min(prompt, _count(details.get("cached_tokens")))
    written = min(prompt - cached, _count(details.get("cache_write_tokens")))
    return {
        "input_tokens": prompt - cached - written,
        "output_tokens": _count(u.get("completion_tokens")),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": written,
    }


def from_openai_chat(answer: dict[str, Any], t: Translated, msg_id: str) -> dict[str, Any]:
    """A whole OpenAI chat completion as an Anthropic message."""
    choice = _dict((_list(answer.get("choices")) or [{}])[0])
    message = _dict(choice.get("message"))
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if t.thinking and isinstance(reasoning, str) and reasoning:
        content.append(
            {"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)}
        )
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = [c for c in _list(message.get("tool_calls")) if isinstance(c, dict)]
    for call in calls:
        function = _dict(call.get("function"))
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.get("id")),
                "name": _str(function.get("name")),
                "input": tool_input(function.get("arguments")),
            }
        )
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), t.stop_sequences, bool(calls)
    )
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": t.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(answer.get("usage")),
    }


# --- errors ----------------------------------------------------------------------------------


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}` for an HTTP status. A prompt over the
    context is worded as Anthropic words it, which is what Claude Code compacts on."""
    if code == "context_length_exceeded":
        found = _CONTEXT.search(message)
        if found and found["prompt"]:
            message = f"prompt is too long: {found['prompt']} tokens > {found['max']} maximum"
        elif found:
            message = f"prompt is too long: over {found['max']} tokens maximum"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# --- streams ---------------------------------------------------------------------------------


_EMPTY_BLOCK: dict[str, dict[str, Any]] = {
    "thinking": {"thinking": "", "signature": ""},
    "text": {"text": ""},
}


class StreamTranslator(OneBlockOpen[Event]):
    """OpenAI chat chunks in, Anthropic stream events out, for one streamed answer.

    `start()` first, `feed()` per upstream chunk, `finish()` when the upstream ends
    (with or without `[DONE]`); after the closing events it ignores everything.
    """

    def __init__(self, t: Translated, msg_id: str, input_tokens: int = 0) -> None:
        super().__init__()  # open_kind: "thinking" | "text" | "tool_use"
        self.t = t
        self.msg_id = msg_id
        self.input_tokens = input_tokens  # an estimate until the upstream's usage arrives
        self.num_blocks = 0  # blocks closed so far: the open block's index
        self.tool_index: int | None = None  # the OpenAI index of the open tool_use block
        self.tools_seen: set[int] = set()
        self.thinking: list[str] = []  # the open thinking block's text, for its signature
        self.num_deltas = 0  # the output count when no usage ever arrives
        self.finish_reason: str | None = None
        self.matched: object = None  # the stop string that ended the answer, if any
        self.usage: dict[str, Any] | None = None
        self.done = False

    def start(self) -> list[Event]:
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.t.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def feed(self, chunk: object) -> list[Event]:
        if self.done or not isinstance(chunk, dict):
            return []
        error = chunk.get("error")
        if isinstance(error, dict):  # the node failed mid-stream
            kind = _OPENAI_ERRORS.get(str(error.get("code"))) or _OPENAI_ERRORS.get(
                str(error.get("type"))
            )
            return self._fail(kind or "api_error", str(error.get("message") or "upstream error"))
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for choice in _list(chunk.get("choices")):
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = _dict(choice.get("delta"))
            reasoning = delta.get("reasoning_content")
            if self.t.thinking and isinstance(reasoning, str) and reasoning:
                events += self.grow("thinking", reasoning)
            text = delta.get("content")
            if isinstance(text, str) and text:
                events += self.grow("text", text)
            for call in _list(delta.get("tool_calls")):
                if isinstance(call, dict):
                    events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.matched = choice.get("stop_reason")
        return events

    def finish(self) -> list[Event]:
        if self.done:
            return []
        if self.finish_reason is None:
            return self._fail("api_error", "the node ended the stream before the answer finished")
        events = self.close()
        if self.num_blocks == 0:  # an empty answer is still one (empty) text block
            events += self.open("text") + self.close()
        reason, sequence = stop_reason(
            self.finish_reason, self.matched, self.t.stop_sequences, bool(self.tools_seen)
        )
        if self.usage is not None:
            counts = usage(self.usage)
        else:
            counts = {"input_tokens": self.input_tokens, "output_tokens": self.num_deltas}
        self.done = True
        return [
            *events,
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": counts,
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        """One OpenAI tool_call delta: the first for an index (with id and name) opens a
        tool_use block, argument fragments become input_json_delta."""
        index = call.get("index", 0)
        if not isinstance(index, int):
            return []
        function = _dict(call.get("function"))
        events: list[Event] = []
        if index != self.tool_index or self.open_kind != "tool_use":
            if index in self.tools_seen:  # a late fragment of a closed block: blocks never reopen
                return []
            block = {"id": tool_use_id(call.get("id")), "name": _str(function.get("name"))}
            events += self.open("tool_use", {**block, "input": {}})
            self.tool_index = index
            self.tools_seen.add(index)
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # some servers send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        if isinstance(arguments, str) and arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    # -- the one open block (OneBlockOpen) ----------------------------------------------
    def _opened(self, kind: str, fields: dict[str, Any] | None) -> list[Event]:
        block = {"type": kind, **(fields if fields is not None else _EMPTY_BLOCK[kind])}
        start = {"type": "content_block_start", "index": self.num_blocks, "content_block": block}
        return [("content_block_start", start)]

    def _grown(self, kind: str, text: str) -> list[Event]:
        if kind == "thinking":
            self.thinking.append(text)
            return [self._delta({"type": "thinking_delta", "thinking": text})]
        return [self._delta({"type": "text_delta", "text": text})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        self.num_deltas += 1
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.num_blocks, "delta": delta},
        )

    def _closed(self, kind: str) -> list[Event]:
        events: list[Event] = []
        if kind == "thinking":
            signature = thinking_signature("".join(self.thinking))
            events.append(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self.num_blocks,
                        "delta": {"type": "signature_delta", "signature": signature},
                    },
                )
            )
            self.thinking = []
        events.append(
            ("content_block_stop", {"type": "content_block_stop", "index": self.num_blocks})
        )
        self.num_blocks += 1
        self.tool_index = None
        return events

    def _fail(self, kind: str, message: str) -> list[Event]:
        events = self.close()
        self.done = True
        return [*events, ("error", {"type": "error", "error": {"type": kind, "message": message}})]


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
