"""OpenAI Responses request bodies, translated to the chat request the node runs. No I/O.

`input` is a string or a list of items — messages (`input_text`/`output_text`/
`input_image` parts, or a plain string), `function_call`, `function_call_output` and
`reasoning` — which become chat messages in order: consecutive function calls join one
assistant turn, a reasoning item rides on the assistant turn that follows it.
`instructions` is the system message. Stored conversations do not exist here, so
`previous_response_id` is refused with `chained_conversation_not_supported`.
`text.format` (flat: `{type: "json_schema", name, schema, strict}`) becomes the chat
`response_format`; errors in it, or in a function tool, name the Responses field path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from helexa.errors import HelexaError, chained_conversation_not_supported, invalid_request
from helexa.protocol.openai import ChatCompletionRequest, parse_chat_request

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Chat paths with a Responses twin: response_format[.json_schema].X, tools[i].function.X
_RESPONSE_FORMAT = re.compile(r"\bresponse_format(?:\.json_schema)?")
_TOOL = re.compile(r"\btools\[(\d+)\](?:\.function)?")
# Fields of the chat request that carry over from the Responses body under the same name.
_SAME_NAME = ("model", "stream", "temperature", "top_p", "user", "parallel_tool_calls", "seed")


@dataclass(slots=True)
class ResponsesRequest:
    """The chat request to run and what the response object echoes back."""

    chat: ChatCompletionRequest
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses_request(body: object) -> ResponsesRequest:
    """Validate a decoded `/v1/responses` body; raises only 400 `HelexaError`s whose
    `param` is the Responses field path (`input[2].call_id`)."""
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object", "body")
    if body.get("previous_response_id") is not None:
        raise chained_conversation_not_supported()
    chat: dict[str, Any] = {k: body[k] for k in _SAME_NAME if body.get(k) is not None}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_request("instructions: expected a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools, tool_indices = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid_request("reasoning: expected an object", "reasoning")
        effort = reasoning.get("effort")
        chat["reasoning_effort"] = effort if isinstance(effort, str) else "medium"
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    try:
        req = parse_chat_request(chat)
    except HelexaError as e:
        _rename(e, _RESPONSE_FORMAT, lambda m: "text.format")
        _rename(e, _TOOL, lambda m: f"tools[{tool_indices[int(m[1])]}]")
        e.param = _responses_param(e.param)
        raise
    req.include_usage = True
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "reasoning": reasoning,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "text": body.get("text") if isinstance(body.get("text"), dict) else None,
        "user": body.get("user"),
    }
    return ResponsesRequest(req, echo)


def _rename(e: HelexaError, pattern: re.Pattern[str], new: Any) -> None:
    """Chat field paths in `e`'s message and param put in Responses terms by `new`."""
    e.message = pattern.sub(new, e.message)
    e.args = (e.message,)
    if e.param is not None:
        e.param = pattern.sub(new, e.param)


def _responses_param(param: str | None) -> str | None:
    """A chat field path put back in Responses terms, where they differ."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    return {"max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}.get(
        param, param
    )


def _input_messages(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_request("input: expected a string or a non-empty array of items", "input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    for i, item in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{path}: expected an object", path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, path)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", path),
                "type": "function",
                "function": {
                    "name": _field(item, "name", path),
                    "arguments": _field(item, "arguments", path, allow_empty=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, f"{path}.output")
            if not isinstance(output, str):
                raise invalid_request(f"{path}.output: expected a string", f"{path}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", path), "content": output}
            )
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = _text_of(parts, f"{path}.summary") if isinstance(parts, list) else None
        elif kind == "item_reference":
            raise chained_conversation_not_supported()
        else:
            raise invalid_request(
                f"{path}.type: expected 'message', 'function_call', 'function_call_output' or "
                f"'reasoning', got {kind!r}",
                f"{path}.type",
            )
    return messages


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid_request(f"{path}.role: expected one of {list(_ROLES)}, got {role!r}", path)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid_request(f"{path}.content: expected a string or an array", f"{path}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{path}.content[{j}]"
        if not isinstance(part, dict):
            raise invalid_request(f"{p}: expected an object", p)
        kind = part.get("type")
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise invalid_request(f"{p}.text: expected a string", f"{p}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid_request(f"{p}.image_url: expected a URL string", f"{p}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid_request(
                f"{p}.type: expected 'input_text', 'output_text' or 'input_image', got {kind!r}",
                f"{p}.type",
            )
    return {"role": role, "content": parts}


def _text_of(parts: list[Any], path: str) -> str:
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise invalid_request(f"{path}: text parts need a string 'text'", path)
    return "\n".join(texts)


def _field(item: dict[str, Any], key: str, path: str, *, allow_empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise invalid_request(f"{path}.{key}: expected a non-empty string", f"{path}.{key}")
    return value


def _tools(value: object) -> tuple[list[dict[str, Any]], list[int]]:
    """Function tools in chat shape, and each one's index among the Responses tools;
    built-in tools (web_search, …) cannot run here and are left out rather than refused."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise invalid_request("tools: expected an array", "tools")
    out, indices = [], []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid_request(f"tools[{i}]: expected an object", f"tools[{i}]")
        if tool.get("type") != "function":
            continue
        function = {"name": _field(tool, "name", f"tools[{i}]")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
        indices.append(i)
    return out, indices


def _text_format(text: object) -> dict[str, Any] | None:
    """`text.format` as the chat `response_format`: a flat `json_schema` format gets its
    fields nested under `json_schema`; the rest (text, json_object, junk) the chat parser
    judges as they are."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_request("text: expected an object", "text")
    spec = text.get("format")
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        return spec
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: spec[k] for k in keys if k in spec}}


def _tool_choice(value: object) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise invalid_request(
        "tool_choice: expected 'none', 'auto', 'required' or {type: 'function', name}",
        "tool_choice",
    )
