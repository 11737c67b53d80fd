"""Rendering a model's chat template the way transformers' `apply_chat_template` does.

Templates come from model repositories, so they are untrusted code: they run in Jinja's
immutable sandbox, and any reach for a Python internal (an `_`-prefixed attribute, `mro`,
a function's globals) fails the render instead of quietly printing nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from helexa.engine.tokenizer import Tokenizer

# Used when the tokenizer ships no template. Content parts keep their text; others are dropped.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRenderError(Exception):
    """A chat template failed to compile or render; the message is Jinja's error text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    template_name: str | None = None,
) -> str:
    """The prompt text for `messages`, byte-identical to HF `apply_chat_template(tokenize=False)`.

    Variables the template sees: `messages` (plain copies: None-valued keys dropped,
    reasoning aliased, JSON-string tool-call arguments parsed to objects), `tools`,
    `documents` (None), `add_generation_prompt`, the tokenizer's special tokens
    (`bos_token`, `eos_token`, ...) and `chat_template_kwargs` (e.g. `enable_thinking`,
    `date_string`), which override the special tokens. Only when that exact render fails
    are the `_FALLBACKS` tried; if none renders, the first error is raised as
    `TemplateRenderError`.
    """
    source = select_template(tokenizer.chat_template, tools=tools, template_name=template_name)
    template = _compile(source)
    try:
        chat = [_plain_message(m) for m in messages]
        variables = {
            **_special_token_variables(tokenizer),
            "documents": None,
            **_plain(chat_template_kwargs or {}),
            "tools": _plain(tools),
            "add_generation_prompt": add_generation_prompt,
        }
    except TypeError as e:
        raise TemplateRenderError(str(e)) from e
    tried: list[list[dict[str, Any]]] = []
    first_error: TemplateRenderError | None = None
    for parse_arguments, null_content in _FALLBACKS:
        attempt = [_prepare_message(m, parse_arguments, null_content) for m in chat]
        if attempt in tried:
            continue
        tried.append(attempt)
        try:
            return _render(template, attempt, variables)
        except TemplateRenderError as e:
            first_error = first_error or e
    assert first_error is not None
    raise first_error


# (parse tool-call arguments, what a `content: null` becomes), in order. The first is exactly
# what HF renders. OpenAI clients send `content: null` on tool-call turns, which HF drops and
# then old Qwen3 and SmolLM2 templates fail on, as they need a string; some templates
# (DeepSeek-R1) concatenate `arguments` as a string.
_FALLBACKS = (
    (True, "drop"),
    (True, "empty"),
    (False, "empty"),
)


def select_template(
    chat_template: str | dict[str, str] | None,
    *,
    tools: list[dict[str, Any]] | None = None,
    template_name: str | None = None,
) -> str:
    """The template to render: `template_name`, else "tool_use" with tools, else "default"."""
    if chat_template is None:
        if template_name is not None:
            raise TemplateRenderError(
                f"no chat template named {template_name!r}: the model has none"
            )
        return CHATML_TEMPLATE
    if isinstance(chat_template, str):
        if template_name not in (None, "default"):
            raise TemplateRenderError(
                f"no chat template named {template_name!r}; the model has a single template"
            )
        return chat_template
    if template_name is not None:
        name = template_name
    elif tools and "tool_use" in chat_template:
        name = "tool_use"
    else:
        name = "default"
    if name not in chat_template:
        raise TemplateRenderError(
            f"no chat template named {name!r}; available: {sorted(chat_template)}"
        )
    return chat_template[name]


def _render(template: jinja2.Template, messages: list[dict[str, Any]], variables: dict) -> str:
    try:
        return template.render(messages=messages, **variables)
    except jinja2.TemplateError as e:
        raise TemplateRenderError(e.message or type(e).__name__) from e
    # Templates do arithmetic and indexing on caller data: any Python error is a render error.
    except Exception as e:
        raise TemplateRenderError(f"{type(e).__name__}: {e}") from e


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but unsafe attribute access raises instead of yielding Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses `_`-prefixed attributes, as transformers' does."""

    # No named `self`, as in Jinja's Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"templates cannot set underscore attributes on a namespace: {name!r}"
            )


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (`<` → `\u003c`) and sorts keys; HF's does neither.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


@lru_cache(maxsize=64)
def _compile_cached(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _compile(source: str) -> jinja2.Template:
    """The compiled template, once per distinct template string."""
    try:
        return _compile_cached(source)
    except jinja2.TemplateError as e:
        raise TemplateRenderError(f"chat template does not compile: {e.message}") from e


def _special_token_variables(tokenizer: Tokenizer) -> dict[str, Any]:
    """What HF passes as `special_tokens_map`: set tokens only, plus the tokenizer's extras."""
    named = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
    }
    return {**{k: v for k, v in named.items() if v is not None}, **_plain(tokenizer.extra)}


def _plain_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
    return _plain(message)


def _prepare_message(
    message: dict[str, Any], parse_arguments: bool, null_content: str
) -> dict[str, Any]:
    """One message as the template gets it: None-valued keys dropped and reasoning aliased,
    as HF does; `null_content="empty"` turns a `content: null` into "" instead."""
    copy = {
        k: "" if v is None else v
        for k, v in message.items()
        if v is not None or (k == "content" and null_content == "empty")
    }
    reasoning = next((copy[k] for k in _REASONING_FIELDS if k in copy), None)
    if reasoning is not None:
        copy = {"thinking": reasoning, **copy, "reasoning_content": reasoning}
    return _with_parsed_arguments(copy) if parse_arguments else copy


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with tool-call arguments that are JSON-object strings parsed to dicts."""
    if not _has_string_arguments(message):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _has_string_arguments(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return isinstance(calls, list) and any(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("arguments"), str)
        for c in calls
    )


def _plain(value: Any) -> Any:
    """A deep copy built from plain JSON types only, so templates never touch caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"
