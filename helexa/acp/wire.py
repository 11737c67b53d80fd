"""The three wire APIs `helexa acp` speaks to a model endpoint, behind one shape: a
conversation of `Message`s and the tools' specs in, a stream of `Event`s out (text,
reasoning, tool calls as they build up, usage, why it stopped), and the endpoint's models.

- `openai-chat`: `POST {base}/chat/completions` (helexa, vLLM, llama.cpp, LM Studio,
  Ollama, OpenRouter, OpenAI); reasoning from `reasoning_content` (or `reasoning`).
- `openai-responses`: `POST {base}/responses`; reasoning from the reasoning text events.
- `anthropic-messages`: `POST {base}/messages`; reasoning from `thinking` blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from helexa.acp.config import Endpoint
from helexa.acp.tools import ToolSpec
from helexa.protocol.wire import SSEReader

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 8192  # Anthropic's API needs one; the others get it only when set
# Anthropic's API shows reasoning only when asked, with a budget of at least 1024 tokens
# below max_tokens: asked for (half of max_tokens) whenever max_tokens leaves room
THINKING_MIN_BUDGET = 1024
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a model may think for minutes before its next byte


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(slots=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    images: list[tuple[str, str]] = field(default_factory=list)  # a user's (mime, base64)


@dataclass(frozen=True, slots=True)
class Event:
    """One piece of a streamed answer. `kind`: text | thought | call (a tool call started:
    `index`, `call_id`, `name`) | args (`index`, `text`: a piece of its arguments) | usage
    (`prompt`, `completion`) | stop (`reason`: stop, length, tool_calls, …)."""

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""
    prompt: int = 0
    completion: int = 0
    reason: str = ""


class WireError(Exception):
    """The endpoint refused or broke off; the message says which and why."""


class Wire:
    """One endpoint's API."""

    def __init__(self, endpoint: Endpoint, client: httpx.AsyncClient | None = None) -> None:
        self.endpoint = endpoint
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.client = client or httpx.AsyncClient(timeout=timeout)

    def headers(self) -> dict[str, str]:
        key = self.endpoint.api_key
        if self.endpoint.wire_api == "anthropic-messages":
            out = {"anthropic-version": ANTHROPIC_VERSION}
            if key:
                out["x-api-key"] = key
            return out
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def models(self) -> list[str]:
        """The ids `GET {base}/models` lists (every wire has it)."""
        r = await self.client.get(self.endpoint.base_url + "/models", headers=self.headers())
        if r.status_code != 200:
            raise WireError(_refusal(r.status_code, r.text))
        data = r.json().get("data")
        if not isinstance(data, list):
            raise WireError("the endpoint's /models answer has no `data` list")
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def stream(
        self,
        model: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
    ) -> AsyncIterator[Event]:
        """The model's answer, event by event."""
        api = self.endpoint.wire_api
        max_tokens = max_tokens or self.endpoint.max_tokens
        if api == "openai-chat":
            path, body, parse = (
                "/chat/completions",
                chat_body(model, messages, tools, max_tokens),
                _ChatParser(),
            )
        elif api == "openai-responses":
            path, body, parse = (
                "/responses",
                responses_body(model, messages, tools, max_tokens),
                _ResponsesParser(),
            )
        else:
            path, body, parse = "/messages", messages_body(model, messages, tools, max_tokens), _MessagesParser()  # fmt: skip
        url = self.endpoint.base_url + path
        try:
            async with self.client.stream("POST", url, json=body, headers=self.headers()) as r:
                if r.status_code != 200:
                    raise WireError(
                        _refusal(r.status_code, (await r.aread()).decode("utf-8", "replace"))
                    )
                reader = SSEReader()
                async for chunk in r.aiter_bytes():
                    for event in reader.feed(chunk):
                        if event.data.strip() == "[DONE]":
                            continue
                        try:
                            obj = json.loads(event.data)
                        except ValueError:
                            continue  # a keep-alive or a line we do not read
                        for out in parse.feed(event.name, obj):
                            yield out
        except httpx.HTTPError as e:
            raise WireError(f"{self.endpoint.name}: {type(e).__name__}: {e}") from None
        if not parse.stopped:
            raise WireError(f"{self.endpoint.name}: the answer broke off before its end")

    async def aclose(self) -> None:
        await self.client.aclose()


def _refusal(status: int, text: str) -> str:
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or text[:500]}"


# -- bodies ------------------------------------------------------------------------------
def chat_body(
    model: str, messages: Sequence[Message], tools: Sequence[ToolSpec], max_tokens: int | None
) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        elif m.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": m.content or None}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in m.tool_calls
                ]
            out.append(entry)
        elif m.role == "user" and m.images:
            parts: list[dict[str, Any]] = [{"type": "text", "text": m.content}] if m.content else []
            parts += [
                {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}
                for mime, data in m.images
            ]
            out.append({"role": "user", "content": parts})
        else:
            out.append({"role": m.role, "content": m.content})
    body: dict[str, Any] = {
        "model": model,
        "messages": out,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = [t.openai() for t in tools]
    if max_tokens:
        body["max_tokens"] = max_tokens
    return body


def responses_body(
    model: str, messages: Sequence[Message], tools: Sequence[ToolSpec], max_tokens: int | None
) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    instructions = "\n\n".join(m.content for m in messages if m.role == "system")
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "tool":
            items.append(
                {"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content}
            )
        elif m.role == "assistant":
            if m.content:
                items.append({"role": "assistant", "content": m.content})
            items += [
                {"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments}
                for c in m.tool_calls
            ]
        else:
            parts: list[dict[str, Any]] = (
                [{"type": "input_text", "text": m.content}] if m.content else []
            )
            parts += [
                {"type": "input_image", "image_url": f"data:{mime};base64,{data}"}
                for mime, data in m.images
            ]
            items.append({"role": "user", "content": parts})
    body: dict[str, Any] = {"model": model, "input": items, "stream": True, "store": False}
    if instructions:
        body["instructions"] = instructions
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            }
            for t in tools
        ]
    if max_tokens:
        body["max_output_tokens"] = max_tokens
    return body


def messages_body(
    model: str, messages: Sequence[Message], tools: Sequence[ToolSpec], max_tokens: int | None
) -> dict[str, Any]:
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:  # tool results join the user turn they belong to
            out[-1]["content"] += blocks
        else:
            out.append({"role": role, "content": blocks})

    for m in messages:
        if m.role == "system":
            continue
        if m.role == "tool":
            add(
                "user",
                [{"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}],
            )
        elif m.role == "assistant":
            blocks: list[dict[str, Any]] = (
                [{"type": "text", "text": m.content}] if m.content else []
            )
            for c in m.tool_calls:
                try:
                    arguments = json.loads(c.arguments or "{}")
                except ValueError:
                    arguments = {}
                if not isinstance(arguments, dict):
                    arguments = {}
                blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": arguments})
            add("assistant", blocks or [{"type": "text", "text": ""}])
        else:
            blocks = [
                {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}
                for mime, data in m.images
            ]
            if m.content or not blocks:
                blocks.append({"type": "text", "text": m.content})
            add("user", blocks)
    body: dict[str, Any] = {
        "model": model,
        "messages": out,
        "stream": True,
        "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
    }
    budget = body["max_tokens"] // 2
    if budget >= THINKING_MIN_BUDGET:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    if system:
        body["system"] = system
    if tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in tools
        ]
    return body


# -- parsers: the wire's events to ours ----------------------------------------------------
class _ChatParser:
    def __init__(self) -> None:
        self.stopped = False
        self._calls: dict[int, str] = {}  # index -> id

    def feed(self, _name: str | None, obj: Any) -> list[Event]:
        if not isinstance(obj, dict):
            return []
        if isinstance(obj.get("error"), dict):
            raise WireError(f"the model's answer failed: {obj['error'].get('message')}")
        out: list[Event] = []
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                out.append(Event("thought", thought))
            if isinstance(delta.get("content"), str) and delta["content"]:
                out.append(Event("text", delta["content"]))
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                fn = call.get("function") or {}
                if index not in self._calls:
                    self._calls[index] = call.get("id") or f"call_{index}"
                    out.append(
                        Event(
                            "call",
                            index=index,
                            call_id=self._calls[index],
                            name=fn.get("name") or "",
                        )
                    )
                if fn.get("arguments"):
                    out.append(Event("args", fn["arguments"], index=index))
            if choice.get("finish_reason"):
                self.stopped = True
                out.append(Event("stop", reason=choice["finish_reason"]))
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out.append(
                Event(
                    "usage",
                    prompt=usage.get("prompt_tokens", 0),
                    completion=usage.get("completion_tokens", 0),
                )
            )
        return out


class _ResponsesParser:
    def __init__(self) -> None:
        self.stopped = False
        self._calls: dict[str, int] = {}  # item id -> our index

    def feed(self, name: str | None, obj: Any) -> list[Event]:
        if not isinstance(obj, dict):
            return []
        kind = obj.get("type") or name
        if kind == "response.output_text.delta":
            return [Event("text", obj.get("delta", ""))]
        if kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            return [Event("thought", obj.get("delta", ""))]
        if kind == "response.output_item.added":
            item = obj.get("item") or {}
            if item.get("type") == "function_call":
                index = self._calls[item.get("id") or str(len(self._calls))] = len(self._calls)
                return [
                    Event(
                        "call",
                        index=index,
                        call_id=item.get("call_id") or item.get("id", ""),
                        name=item.get("name", ""),
                    )
                ]
            return []
        if kind == "response.function_call_arguments.delta":
            index = self._calls.get(obj.get("item_id", ""), max(self._calls.values(), default=0))
            return [Event("args", obj.get("delta", ""), index=index)]
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = obj.get("response") or {}
            if kind == "response.failed":
                error = response.get("error") or {}
                raise WireError(f"the model's answer failed: {error.get('message') or error}")
            self.stopped = True
            usage = response.get("usage") or {}
            reason = "tool_calls" if self._calls else "stop"
            if kind == "response.incomplete":
                reason = (response.get("incomplete_details") or {}).get("reason") or "length"
                reason = "length" if reason == "max_output_tokens" else reason
            return [
                Event(
                    "usage",
                    prompt=usage.get("input_tokens", 0),
                    completion=usage.get("output_tokens", 0),
                ),
                Event("stop", reason=reason),
            ]
        if kind == "error":
            raise WireError(f"the model's answer failed: {obj.get('message')}")
        return []


class _MessagesParser:
    def __init__(self) -> None:
        self.stopped = False
        self._blocks: dict[int, str] = {}  # block index -> its type
        self._calls: dict[int, int] = {}  # block index -> our call index
        self._prompt = 0

    def feed(self, name: str | None, obj: Any) -> list[Event]:
        if not isinstance(obj, dict):
            return []
        kind = obj.get("type") or name
        if kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            self._prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
            return []
        if kind == "content_block_start":
            index, block = obj.get("index", 0), obj.get("content_block") or {}
            self._blocks[index] = block.get("type", "")
            if block.get("type") == "tool_use":
                call = self._calls[index] = len(self._calls)
                return [
                    Event(
                        "call", index=call, call_id=block.get("id", ""), name=block.get("name", "")
                    )
                ]
            if block.get("type") == "text" and block.get("text"):
                return [Event("text", block["text"])]
            return []
        if kind == "content_block_delta":
            index, delta = obj.get("index", 0), obj.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [Event("text", delta.get("text", ""))]
            if delta.get("type") == "thinking_delta":
                return [Event("thought", delta.get("thinking", ""))]
            if delta.get("type") == "input_json_delta" and index in self._calls:
                return [Event("args", delta.get("partial_json", ""), index=self._calls[index])]
            return []
        if kind == "message_delta":
            reason = (obj.get("delta") or {}).get("stop_reason") or "stop"
            usage = obj.get("usage") or {}
            self.stopped = True
            reason = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}.get(
                reason, reason
            )
            return [
                Event("usage", prompt=self._prompt, completion=usage.get("output_tokens", 0)),
                Event("stop", reason=reason),
            ]
        if kind == "error":
            error = obj.get("error") or {}
            raise WireError(f"the model's answer failed: {error.get('message') or error}")
        return []
