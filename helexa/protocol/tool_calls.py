"""Tool calls out of a model's text: `<tool_call>…</tool_call>` blocks found in a stream of
decoded text however the markers fall across chunks, their bodies parsed. No I/O.

Two body formats are read, whichever the model wrote:
- JSON (Hermes, Qwen3): `{"name": "f", "arguments": {...}}`, with small slips repaired
  (a few extra closing braces, `name` nested inside `arguments`, arguments as a string);
- Qwen XML (Qwen3-Coder, Qwen3.5): `<function=f><parameter=p>value</parameter></function>`,
  each value coerced to the type the tool's JSON schema declares for it. A value that does
  not fit its declared type stays a string: an argument is never dropped.

A body that parses as neither is given back as text, markers included: it never vanishes.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from helexa.protocol.markers import MarkerPair, held_back

MAX_EXTRA_BRACES = 3


@dataclass(frozen=True, slots=True)
class ToolCallMarkers(MarkerPair):
    KNOWN = (("<tool_call>", "</tool_call>"),)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its `parameters` JSON schema


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of OpenAI-shaped tools."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = params if isinstance(params, dict) else {}
    return out


# -- bodies ----------------------------------------------------------------------------------


def parse_tool_call_body(body: str, schemas: Schemas) -> ParsedCall | None:
    """The call a `<tool_call>` body describes, or None when it is neither JSON nor Qwen XML."""
    text = body.strip()
    if not text:
        return None
    if text.startswith("{"):
        return _parse_json_body(text, schemas)
    if "<function=" in text:
        return _parse_xml_body(text, schemas)
    return None


def _parse_json_body(text: str, schemas: Schemas) -> ParsedCall | None:
    obj = _loads_repaired(text)
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # arguments written as a JSON string
        parsed = _loads_repaired(args) if args.strip() else {}
        args = parsed if isinstance(parsed, dict) else None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    name = obj.get("name")
    nested = args.get("name")
    # `name` nested inside `arguments`: hoist it, unless it is a real parameter there
    if (
        not isinstance(name, str)
        and isinstance(nested, str)
        and not _has_name_param(schemas, nested)
    ):
        name = nested
        args = {k: v for k, v in args.items() if k != "name"}
    if not isinstance(name, str) or not name:
        return None
    schema = schemas.get(name)
    props = _properties(schema)
    coerced = {
        k: coerce_value(v, props[k]) if isinstance(v, str) and k in props else v
        for k, v in args.items()
    }
    return ParsedCall(name, coerced)


def _loads_repaired(text: str) -> Any:
    """json.loads, forgiving up to MAX_EXTRA_BRACES stray closing braces at the end."""
    for _ in range(MAX_EXTRA_BRACES + 1):
        try:
            return json.loads(text)
        except ValueError:
            stripped = text.rstrip()
            if not stripped.endswith("}"):
                return None
            text = stripped[:-1]
    return None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _parse_xml_body(text: str, schemas: Schemas) -> ParsedCall | None:
    m = _FUNCTION.search(text)
    if m is None:
        return None
    name = m.group(1).strip()
    if not name:
        return None
    props = _properties(schemas.get(name))
    args: dict[str, Any] = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key = p.group(1).strip()
        value = _strip_one_newline(p.group(2))
        if key in props:
            args[key] = coerce_value(value, props[key])
        elif name not in schemas:
            args[key] = _sniff(value)  # an undeclared tool: read the value for what it looks like
        else:
            args[key] = value
    return ParsedCall(name, args)


def _has_name_param(schemas: Schemas, tool: str) -> bool:
    return "name" in _properties(schemas.get(tool))


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return props if isinstance(props, Mapping) else {}


# -- values ----------------------------------------------------------------------------------


def _declared_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in order (`anyOf`/`oneOf` flattened)."""
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if t else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += _declared_types(sub)
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def coerce_value(raw: str, schema: Any) -> Any:
    """`raw` as the first type its schema allows that it fits; else `raw` unchanged."""
    types = _declared_types(schema)
    if not types or "string" in types[:1]:
        return raw
    text = raw.strip()
    for t in types:
        if t == "string":
            return raw
        value = _as_type(text, t)
        if value is not _MISS:
            return value
    return raw


_MISS = object()


def _as_type(text: str, t: str) -> Any:
    low = text.lower()
    if t == "null":
        return None if low in ("null", "none") else _MISS
    if t == "boolean":
        return {"true": True, "false": False}.get(low, _MISS)
    if t == "integer":
        try:
            return int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                return _MISS
            return int(f) if f.is_integer() else _MISS
    if t == "number":
        try:
            f = float(text)
        except ValueError:
            return _MISS
        if f != f or f in (float("inf"), float("-inf")):
            return _MISS
        return int(f) if f.is_integer() and "." not in text and "e" not in low else f
    if t in ("object", "array"):
        kind = dict if t == "object" else list
        try:
            value = json.loads(text)
        except ValueError:
            try:  # Python literals ({'a': 1}, True) are a common slip
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return _MISS
        return value if isinstance(value, kind) else _MISS
    return _MISS


def _sniff(raw: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if not isinstance(value, float) or value == value else raw


# -- the stream ------------------------------------------------------------------------------


class ToolCallSplitter:
    """Feed decoded text as it comes; get back text pieces and parsed calls, in order.

    Text inside a block is held until its end marker; text that may be the start of the
    start marker is held until the next chunk says what it was."""

    def __init__(
        self, markers: ToolCallMarkers, schemas: Schemas, *, call_prefix: str | None = None
    ) -> None:
        self.markers = markers
        self.schemas = schemas
        # a prompt that ended inside a call's block (with `call_prefix` after the marker)
        self.in_call = call_prefix is not None
        self._pending = call_prefix or ""
        self._after_call = False  # whitespace between and after calls is not text

    def feed(self, text: str) -> list[str | ParsedCall]:
        buffer = self._pending + text
        self._pending = ""
        out: list[str | ParsedCall] = []
        while buffer:
            if self.in_call:
                at = buffer.find(self.markers.end)
                if at < 0:
                    self._pending = buffer  # the body, until its end marker comes
                    break
                self._close(buffer[:at], out)
                buffer = buffer[at + len(self.markers.end) :]
                continue
            at = buffer.find(self.markers.start)
            if at < 0:
                keep = held_back(buffer, [self.markers.start])
                head, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
                self._text(head, out)
                break
            self._text(buffer[:at], out)
            buffer = buffer[at + len(self.markers.start) :]
            self.in_call = True
        return out

    def flush(self) -> list[str | ParsedCall]:
        """The end of the stream: a block left open is parsed if it can be, else text."""
        out: list[str | ParsedCall] = []
        pending, self._pending = self._pending, ""
        if self.in_call:
            call = parse_tool_call_body(pending, self.schemas)
            out.append(call if call is not None else self.markers.start + pending)
            self.in_call = False
        else:
            self._text(pending, out)
        return out

    def _text(self, text: str, out: list[str | ParsedCall]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(text)

    def _close(self, body: str, out: list[str | ParsedCall]) -> None:
        self.in_call = False
        if not body.strip():
            return  # an empty block is nothing, not text
        call = parse_tool_call_body(body, self.schemas)
        out.append(call if call is not None else self.markers.start + body + self.markers.end)
        self._after_call = call is not None
