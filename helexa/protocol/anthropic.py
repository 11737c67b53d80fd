"""Anthropic Messages API requests as the node's OpenAI chat bodies. No I/O.

Strict about types, lenient about everything else: unknown fields, beta features,
`cache_control`, `metadata` and unknown block types are ignored, never refused. A
validation failure is a 400 whose `param` and message name the Anthropic field path.
(Answers, streamed or whole, and errors go back through `helexa.protocol.anthropic_out`.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from helexa.errors import invalid_request
from helexa.protocol.fields import array as _list
from helexa.protocol.fields import boolean as _bool
from helexa.protocol.fields import fail as _fail
from helexa.protocol.fields import integer as _int
from helexa.protocol.fields import number as _float
from helexa.protocol.fields import object_value as _object
from helexa.protocol.fields import string as _str
from helexa.protocol.structured import check_schema

# Claude Code's first system block changes with every prompt; it is billing metadata, not
# instructions, and would defeat the node's prefix cache if rendered into the prompt.
BILLING_HEADER = "x-anthropic-billing-header:"
DEFAULT_SCHEMA = {"type": "object", "properties": {}}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING_ON = ("enabled", "adaptive")


@dataclass(slots=True)
class Translated:
    """An Anthropic request as the OpenAI chat body for the node, and what its answer needs."""

    model: str  # as the client named it (answers echo it)
    body: dict[str, Any]
    stream: bool = False
    thinking: bool = False  # the client asked for thinking blocks
    stop_sequences: list[str] = field(default_factory=list)


# --- requests --------------------------------------------------------------------------------


def to_openai_chat(body: object, *, counting: bool = False) -> Translated:
    """Validate a decoded `/v1/messages` body (`counting`: a `count_tokens` body, which has no
    max_tokens) and translate it; raises only the 400 `HelexaError`."""
    d = _object(body, "body")
    model = _str(d, "model", required=True)
    if not model:
        _fail("model", "a non-empty string", model)
    messages = _list(d, "messages", required=True)
    if not messages:
        _fail("messages", "a non-empty array", messages)
    system = _system(d.get("system"), "system")
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        path = f"messages[{i}]"
        md = _object(m, path)
        role = md.get("role")
        if role == "system":  # Claude Code sends these mid-conversation; templates want one
            system += _system(md.get("content"), f"{path}.content")
        elif role == "user":
            turns += _user_turn(_blocks(md.get("content"), f"{path}.content"), f"{path}.content")
        elif role == "assistant":
            turns.append(_assistant_turn(_blocks(md.get("content"), f"{path}.content"), path))
        else:
            _fail(f"{path}.role", "'user' or 'assistant'", role)
    out: dict[str, Any] = {"model": model, "messages": turns}
    if system:
        out["messages"] = [{"role": "system", "content": "\n\n".join(system)}, *turns]
    tools = _tools(_list(d, "tools") or [])
    if tools:
        out["tools"] = tools
        _tool_choice(d.get("tool_choice"), tools, out)
    thinking = _thinking(d.get("thinking"))
    out["chat_template_kwargs"] = {"enable_thinking": thinking}
    response_format = _response_format(d)
    if response_format is not None:
        out["response_format"] = response_format
    t = Translated(model=model, body=out, thinking=thinking)
    if counting:
        return t
    out["max_tokens"] = _int(d, "max_tokens", required=True, low=1)
    for name in ("temperature", "top_p"):
        if d.get(name) is not None:
            out[name] = _float(d, name)
    if d.get("top_k") is not None:
        out["top_k"] = _int(d, "top_k", low=0)
    stops = _list(d, "stop_sequences") or []
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            _fail(f"stop_sequences[{i}]", "a string", s)
    if stops:
        out["stop"] = list(stops)
    t.stop_sequences = list(stops)
    t.stream = _bool(d, "stream")
    out["stream"] = t.stream
    return t


def tokenize_body(t: Translated, model_id: str) -> dict[str, Any]:
    """The node's `POST /tokenize` body that counts the prompt `t` would render to."""
    body = {
        "model": model_id,
        "messages": t.body["messages"],
        "add_generation_prompt": True,
        "chat_template_kwargs": t.body["chat_template_kwargs"],
    }
    if "tools" in t.body:
        body["tools"] = t.body["tools"]
    return body


def _system(value: object, path: str) -> list[str]:
    """System text pieces from a string or text blocks (other block kinds are ignored)."""
    if value is None:
        return []
    texts = [b["text"] for b in _blocks(value, path) if b["type"] == "text"]
    return [t for t in texts if t and not t.startswith(BILLING_HEADER)]


def _blocks(value: object, path: str) -> list[dict[str, Any]]:
    """Content as a list of blocks, each an object with a string `type`."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        _fail(path, "a string or an array of content blocks", value)
    for i, block in enumerate(value):
        b = _object(block, f"{path}[{i}]")
        _str(b, "type", required=True, prefix=f"{path}[{i}].")
        if b["type"] == "text":
            _str(b, "text", required=True, prefix=f"{path}[{i}].")
    return value


def _user_turn(blocks: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """Tool results first, in order, as `role:"tool"` messages; then the user's own parts
    (with any images the tool results carried, which tool messages cannot)."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, b in enumerate(blocks):
        bp = f"{path}[{i}]"
        if b["type"] == "tool_result":
            tool_use_id = _str(b, "tool_use_id", required=True, prefix=f"{bp}.")
            text, images = _tool_result_content(b.get("content"), f"{bp}.content")
            if _bool(b, "is_error", prefix=f"{bp}."):
                text = f"Error: {text}" if text else "Error"
            tools.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
            parts += images
        else:
            parts += _user_part(b, bp)
    if not parts:
        return tools or [{"role": "user", "content": ""}]
    if all(p["type"] == "text" for p in parts):
        content: Any = "\n".join(p["text"] for p in parts)
    else:
        content = parts
    return [*tools, {"role": "user", "content": content}]


def _user_part(b: dict[str, Any], path: str) -> list[dict[str, Any]]:
    kind = b["type"]
    if kind == "text":
        return [{"type": "text", "text": b["text"]}]
    if kind == "image":
        return [_image(b, path)]
    if kind == "document":
        return [{"type": "text", "text": _document_text(b, path)}]
    return []  # thinking echoed in a user turn, server tool results, ...: not for the model


def _tool_result_content(value: object, path: str) -> tuple[str, list[dict[str, Any]]]:
    if value is None:
        return "", []
    texts, images = [], []
    for i, b in enumerate(_blocks(value, path)):
        if b["type"] == "text":
            texts.append(b["text"])
        elif b["type"] == "image":
            images.append(_image(b, f"{path}[{i}]"))
        elif b["type"] == "document":
            texts.append(_document_text(b, f"{path}[{i}]"))
        elif isinstance(b.get("text"), str):  # search results and the like carry text
            texts.append(b["text"])
    return "\n".join(texts), images


def _image(b: dict[str, Any], path: str) -> dict[str, Any]:
    source = _object(b.get("source"), f"{path}.source")
    kind = _str(source, "type", required=True, prefix=f"{path}.source.")
    if kind == "base64":
        media = _str(source, "media_type", required=True, prefix=f"{path}.source.")
        data = _str(source, "data", required=True, prefix=f"{path}.source.")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = _str(source, "url", required=True, prefix=f"{path}.source.")
    else:
        _fail(f"{path}.source.type", "'base64' or 'url' (uploaded files are not supported)", kind)
    return {"type": "image_url", "image_url": {"url": url}}


def _document_text(b: dict[str, Any], path: str) -> str:
    """A document's text; a PDF becomes a note saying it was left out, as refusing it would
    refuse every later turn of an agent's conversation that once read one."""
    source = _object(b.get("source"), f"{path}.source")
    kind = source.get("type")
    if kind == "text":
        return _str(source, "data", required=True, prefix=f"{path}.source.")
    if kind == "content":
        text, _ = _tool_result_content(source.get("content"), f"{path}.source.content")
        return text
    title = b.get("title") if isinstance(b.get("title"), str) else "a document"
    return f"[{title} ({source.get('media_type') or kind}) left out: this server reads text only]"


def _assistant_turn(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for i, b in enumerate(blocks):
        bp = f"{path}.content[{i}]"
        if b["type"] == "text":
            texts.append(b["text"])
        elif b["type"] == "thinking":  # echoed back with its signature: the reasoning stays
            thoughts.append(_str(b, "thinking", prefix=f"{bp}.") or "")
        elif b["type"] == "tool_use":
            tool_input = b.get("input")
            if tool_input is None:
                tool_input = {}
            if not isinstance(tool_input, dict):
                _fail(f"{bp}.input", "an object", tool_input)
            calls.append(
                {
                    "id": _str(b, "id", required=True, prefix=f"{bp}."),
                    "type": "function",
                    "function": {
                        "name": _str(b, "name", required=True, prefix=f"{bp}."),
                        "arguments": json.dumps(tool_input, ensure_ascii=False),
                    },
                }
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
        if not texts:
            msg["content"] = None
    thinking = "\n".join(t for t in thoughts if t)
    if thinking:
        msg["reasoning_content"] = thinking
    return msg


def _tools(value: list[Any]) -> list[dict[str, Any]]:
    """Custom tools as OpenAI function tools, schemas passed through untouched (a strict
    tool's checked to be one the node can enforce); Anthropic's own server and built-in
    tools (`web_search_…`, `bash_…`) have nothing to run them here."""
    tools = []
    for i, t in enumerate(value):
        path = f"tools[{i}]"
        d = _object(t, path)
        if d.get("type") not in (None, "custom"):
            continue
        schema = d.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            _fail(f"{path}.input_schema", "a JSON schema object", schema)
        function: dict[str, Any] = {"name": _str(d, "name", required=True, prefix=f"{path}.")}
        description = _str(d, "description", prefix=f"{path}.")
        if description is not None:
            function["description"] = description
        function["parameters"] = schema if schema is not None else dict(DEFAULT_SCHEMA)
        if _bool(d, "strict", prefix=f"{path}."):
            check_schema(function["parameters"], f"{path}.input_schema")
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object, tools: list[dict[str, Any]], out: dict[str, Any]) -> None:
    if value is None:
        return
    d = _object(value, "tool_choice")
    kind = _str(d, "type", required=True, prefix="tool_choice.")
    if kind == "tool":
        name = _str(d, "name", required=True, prefix="tool_choice.")
        names = sorted(t["function"]["name"] for t in tools)
        if name not in names:
            raise invalid_request(
                f"tool_choice.name: {name!r} is not among the tools {names}", "tool_choice.name"
            )
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        _fail("tool_choice.type", "'auto', 'any', 'tool' or 'none'", kind)
    if _bool(d, "disable_parallel_tool_use", prefix="tool_choice."):
        out["parallel_tool_calls"] = False


def _thinking(value: object) -> bool:
    """Whether reasoning is on: `enabled` (with a budget) or `adaptive`; off when absent."""
    if value is None:
        return False
    d = _object(value, "thinking")
    kind = _str(d, "type", required=True, prefix="thinking.")
    if d.get("budget_tokens") is not None:
        _int(d, "budget_tokens", low=0, prefix="thinking.")
    return kind in _THINKING_ON


def _response_format(d: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (or the older `output_format`) with a JSON schema, as OpenAI
    strict structured output, the schema checked to be one the node can enforce."""
    config = d.get("output_config")
    spec, path = config.get("format") if isinstance(config, dict) else None, "output_config.format"
    if spec is None:
        spec, path = d.get("output_format"), "output_format"
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        return None
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        _fail(f"{path}.schema", "a JSON schema object", schema)
    check_schema(schema, f"{path}.schema")
    spec = {"name": "output", "schema": schema, "strict": True}
    return {"type": "json_schema", "json_schema": spec}
