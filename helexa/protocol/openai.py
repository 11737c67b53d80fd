"""OpenAI chat/completions request bodies: parsed into typed dataclasses, no I/O.

Strict about types, lenient about unknown fields (ignored, never refused). Every validation
failure is a 400 `invalid_request_error` whose `param` is the field path
(`messages[2].content`, `temperature`) and whose message says what was expected and got.
A `null` optional field means the same as an absent one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helexa.errors import HelexaError, invalid_request
from helexa.protocol.fields import array as _list
from helexa.protocol.fields import boolean as _bool
from helexa.protocol.fields import fail as _fail
from helexa.protocol.fields import int_value as _int_value
from helexa.protocol.fields import integer as _int
from helexa.protocol.fields import mapping as _dict
from helexa.protocol.fields import number as _float
from helexa.protocol.fields import object_value as _object
from helexa.protocol.fields import string as _str
from helexa.protocol.structured import ResponseFormat, check_schema, parse_request_format

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries (OpenAI's own bound)
MAX_TOP_K = 2**31 - 1  # any larger value means "off" anyway; beyond int64 breaks tensors
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_SEED_RANGE = (-(2**63), 2**64 - 1)
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str | dict[str, Any]  # as sent; render_chat parses JSON strings itself
    type: str = "function"


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str | list[dict[str, Any]] | None  # parts: {type:"text"|"image_url"|...}
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


@dataclass(slots=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False  # calls must match `parameters` exactly

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema: `parameters`, or an empty object's when none was given."""
        return self.parameters if self.parameters is not None else dict(EMPTY_PARAMETERS)


@dataclass(slots=True)
class _Sampling:
    """Fields shared by chat and completions requests."""

    model: str
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None
    logit_bias: dict[int, float] | None = None  # token id → bias added to its logit
    # response_format, guided_json or structured_outputs; None or type "text": unconstrained
    response_format: ResponseFormat | None = None


@dataclass(slots=True)
class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"  # "none"|"auto"|"required"|{type, function}
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    # `x-include-thinking: true`: reasoning inline in the content, inside its markers
    include_thinking: bool = False

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_reasoning(self) -> bool:
        """Whether the caller asked to see reasoning: `reasoning_effort` other than "none",
        or `x-include-thinking`. A caller that did not ask gets none generated."""
        if self.reasoning_effort is not None:
            return self.reasoning_effort != "none"
        return self.include_thinking

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` with `enable_thinking` defaulted from `wants_reasoning`
        (so hidden thinking never eats the token budget); an explicit value wins."""
        kwargs = dict(self.chat_template_kwargs)
        kwargs.setdefault("enable_thinking", self.wants_reasoning)
        return kwargs

    @property
    def forced_tool(self) -> str | None:
        """The function `tool_choice` names, "*" for "required", None when calls are optional."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return "*" if self.tool_choice == "required" else None


@dataclass(slots=True)
class CompletionRequest(_Sampling):
    prompt: str | list[int] = ""
    echo: bool = False
    logprobs: int | None = None  # legacy completions: number of alternatives

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


# --- the parsers -----------------------------------------------------------------------------


def parse_chat_request(body: object) -> ChatCompletionRequest:
    """Validate a decoded `/v1/chat/completions` body; raises only the 400 `HelexaError`."""
    d = _object(body, "body")
    req = ChatCompletionRequest(model=_str(d, "model", required=True))
    _parse_sampling(d, req)
    messages = _list(d, "messages", required=True)
    if not messages:
        _fail("messages", "a non-empty array", messages)
    req.messages = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    req.max_completion_tokens = _int(d, "max_completion_tokens", low=1)
    req.logprobs = _bool(d, "logprobs", False)
    req.top_logprobs = _int(d, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    req.tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(d, "tools") or [])]
    req.tool_choice = _tool_choice(d.get("tool_choice"), req.tools)
    req.parallel_tool_calls = _bool(d, "parallel_tool_calls", True)
    req.chat_template_kwargs = _dict(d, "chat_template_kwargs") or {}
    req.reasoning_effort = _str(d, "reasoning_effort")
    return req


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a decoded `/v1/completions` body; raises only the 400 `HelexaError`."""
    d = _object(body, "body")
    req = CompletionRequest(model=_str(d, "model", required=True))
    _parse_sampling(d, req)
    req.prompt = _prompt(d.get("prompt"))
    if d.get("suffix") is not None:
        raise invalid_request("suffix is not supported; send it as part of the prompt", "suffix")
    req.echo = _bool(d, "echo", False)
    req.logprobs = _int(d, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    return req


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Plain message dicts for `render_chat`: all-text part lists joined with "\\n" (as vLLM
    does), lists with other parts kept for multimodal templates; None fields left out."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": _template_content(m.content)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools in OpenAI shape for `render_chat`, or None when there are none (or "none")."""
    if not req.tools or req.tool_choice == "none":
        return None
    tools = []
    for t in req.tools:
        function: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            function["description"] = t.description
        if t.parameters is not None:
            function["parameters"] = t.parameters
        tools.append({"type": "function", "function": function})
    return tools


def has_image_parts(req: ChatCompletionRequest) -> bool:
    return any(
        isinstance(m.content, list) and any(p["type"] == "image_url" for p in m.content)
        for m in req.messages
    )


# --- pieces ----------------------------------------------------------------------------------


def _parse_sampling(d: dict[str, Any], req: _Sampling) -> None:
    req.stream = _bool(d, "stream", False)
    options = _dict(d, "stream_options") or {}
    req.include_usage = _bool(options, "include_usage", False, "stream_options.")
    req.n = _int(d, "n", low=1, high=MAX_N) or 1
    req.max_tokens = _int(d, "max_tokens", low=1)
    for name in FLOAT_FIELDS:
        setattr(req, name, _float(d, name))
    req.top_k = _int(d, "top_k", high=MAX_TOP_K)
    req.seed = _int(d, "seed", low=_SEED_RANGE[0], high=_SEED_RANGE[1])
    req.stop = _stop(d.get("stop"))
    ids = _list(d, "stop_token_ids") or []
    req.stop_token_ids = [_int_value(v, f"stop_token_ids[{i}]", 0) for i, v in enumerate(ids)]
    req.ignore_eos = _bool(d, "ignore_eos", False)
    req.min_tokens = _int(d, "min_tokens", low=0) or 0
    req.skip_special_tokens = _bool(d, "skip_special_tokens", True)
    req.user = _str(d, "user")
    req.logit_bias = _logit_bias(_dict(d, "logit_bias"))
    req.response_format = parse_request_format(d)


def _message(value: object, path: str) -> ChatMessage:
    d = _object(value, path)
    role = _str(d, "role", required=True, prefix=f"{path}.")
    if role == "function":
        raise invalid_request(
            f"{path}.role: the legacy 'function' role is not supported; send tool results "
            "with role 'tool' and a tool_call_id",
            f"{path}.role",
        )
    if role not in ROLES:
        _fail(f"{path}.role", f"one of {list(ROLES)}", role)
    p = f"{path}."
    msg = ChatMessage(role=role, content=None)
    calls = _list(d, "tool_calls", p)
    if calls is not None:
        if role != "assistant":
            raise invalid_request(
                f"{p}tool_calls: only assistant messages carry tool_calls", f"{p}tool_calls"
            )
        msg.tool_calls = [_tool_call(c, f"{p}tool_calls[{i}]") for i, c in enumerate(calls)]
    msg.content = _content(d.get("content"), f"{p}content", null_ok=msg.tool_calls is not None)
    msg.name = _str(d, "name", prefix=p)
    msg.tool_call_id = _str(d, "tool_call_id", prefix=p)
    msg.reasoning_content = _str(d, "reasoning_content", prefix=p)
    return msg


def _content(value: object, path: str, *, null_ok: bool) -> str | list[dict[str, Any]] | None:
    if value is None:
        if null_ok:
            return None
        _fail(path, "a string or an array of content parts", value)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        _fail(path, "a string or an array of content parts", value)
    parts = []
    for i, part in enumerate(value):
        pp = f"{path}[{i}]"
        d = _object(part, pp)
        kind = _str(d, "type", required=True, prefix=f"{pp}.")
        if kind == "text":
            parts.append({"type": "text", "text": _str(d, "text", required=True, prefix=f"{pp}.")})
        elif kind == "image_url":
            image = _object(d.get("image_url"), f"{pp}.image_url")
            url = _str(image, "url", required=True, prefix=f"{pp}.image_url.")
            parts.append({"type": "image_url", "image_url": {**image, "url": url}})
        else:
            parts.append(dict(d))  # audio, files, ...: kept for templates that know them
    return parts


def _template_content(content: str | list[dict[str, Any]] | None) -> Any:
    if isinstance(content, list) and all(p["type"] == "text" for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def _function_entry(value: object, path: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A `{type: "function", function: {...}}` object: (itself, its function, the
    function's field-path prefix)."""
    d = _object(value, path)
    kind = _str(d, "type", prefix=f"{path}.") or "function"
    if kind != "function":
        _fail(f"{path}.type", "'function'", kind)
    return d, _object(d.get("function"), f"{path}.function"), f"{path}.function."


def _tool_call(value: object, path: str) -> ToolCall:
    d, function, fp = _function_entry(value, path)
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str | dict):
        _fail(f"{fp}arguments", "a JSON string or an object", arguments)
    return ToolCall(
        id=_str(d, "id", prefix=f"{path}.") or "",
        name=_str(function, "name", required=True, prefix=fp),
        arguments=arguments,
    )


def _tool(value: object, path: str) -> Tool:
    """A function tool; a strict one's schema is checked to be one the grammar engine can
    enforce exactly. (A forced tool that is not strict is held to its schema as far as the
    engine can: agents' tools use `propertyNames` and the like, and refusing them would
    refuse the agent's forced calls.)"""
    _, function, fp = _function_entry(value, path)
    tool = Tool(
        name=_str(function, "name", required=True, prefix=fp),
        description=_str(function, "description", prefix=fp),
        parameters=_dict(function, "parameters", fp),
        strict=_bool(function, "strict", False, fp),
    )
    if tool.strict:
        check_schema(tool.parameters_schema, f"{fp}parameters")
    return tool


def _tool_choice(value: object, tools: list[Tool]) -> str | dict[str, Any]:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            _fail("tool_choice", "'none', 'auto', 'required' or a function object", value)
        if value == "required" and not tools:
            raise invalid_request(
                "tools: tool_choice 'required' needs a non-empty tools array", "tools"
            )
        return value
    d = _object(value, "tool_choice")
    if d.get("type", "function") != "function":
        _fail("tool_choice.type", "'function'", d.get("type"))
    function = _object(d.get("function"), "tool_choice.function")
    name = _str(function, "name", required=True, prefix="tool_choice.function.")
    if name not in {t.name for t in tools}:
        raise invalid_request(
            f"tool_choice.function.name: {name!r} is not among the tools "
            f"{sorted(t.name for t in tools)}",
            "tool_choice.function.name",
        )
    return {"type": "function", "function": {"name": name}}


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        _fail("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise invalid_request(f"stop: at most {MAX_STOP} stop sequences, got {len(value)}", "stop")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            _fail(f"stop[{i}]", "a string", s)
    return list(value)


def _logit_bias(value: dict[str, Any] | None) -> dict[int, float] | None:
    """`{"<token id>": bias}` with biases in [-100, 100], as OpenAI takes it."""
    if not value:
        return None
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_request(
            f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(value)}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        path = f"logit_bias.{key}"
        if not key.isdigit():
            _fail(path, "a token id (a non-negative integer as a string) as the key", key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            _fail(path, "a number in -100..100", bias)
        out[int(key)] = float(bias)
    return out


def _prompt(value: object) -> str | list[int]:
    batch = "batch prompts are not supported; send one prompt per request"
    if value is None:
        _fail("prompt", "a string or an array of token ids", value)
    if isinstance(value, str):
        if not value:
            raise invalid_request("prompt: must not be empty", "prompt")
        return value
    if not isinstance(value, list):
        _fail("prompt", "a string or an array of token ids", value)
    if not value:
        raise invalid_request("prompt: must not be empty", "prompt")
    if isinstance(value[0], str | list):
        if len(value) != 1:
            raise invalid_request(f"prompt: {batch}, got {len(value)} prompts", "prompt")
        return _prompt(value[0]) if isinstance(value[0], str) else _token_ids(value[0], "[0]")
    return _token_ids(value, "")


def _token_ids(value: list[Any], suffix: str) -> list[int]:
    if not value:
        raise invalid_request(f"prompt{suffix}: must not be empty", f"prompt{suffix}")
    return [_int_value(v, f"prompt{suffix}[{i}]", 0) for i, v in enumerate(value)]


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "HelexaError",
    "ResponseFormat",
    "Tool",
    "ToolCall",
    "has_image_parts",
    "parse_chat_request",
    "parse_completion_request",
    "template_messages",
    "template_tools",
]
