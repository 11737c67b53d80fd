"""Structured-output requests in one typed shape, and the check that a JSON schema asks
only for what the grammar engine can enforce. Pure Python, no I/O.

Every route's way of asking (chat `response_format`, vLLM's `guided_json` and
`structured_outputs`, Responses' `text.format`, Anthropic's `output_config.format`) becomes
a `ResponseFormat`; a schema the engine cannot enforce is a 400 naming the feature and its
path before anything runs, never a constraint silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from helexa.errors import invalid_request
from helexa.protocol.fields import boolean, fail, object_value, string

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# String formats the grammar engine enforces; any other `format` is refused.
SUPPORTED_FORMATS = (
    "date",
    "time",
    "date-time",
    "duration",
    "email",
    "uuid",
    "ipv4",
    "ipv6",
    "hostname",
    "uri",
    "uri-reference",
)
# Formats the engine enforces as these patterns rather than the grammar engine's own, which
# are looser than the validators clients check answers with (or, in a Qwen XML call's raw
# parameters, absent): calendar dates (29 February only in leap years; no year 0000), times
# without leap seconds, hostname labels of 1-63 characters and 253 in all (up to 4 labels of
# any length, or 5-8 labels of up to 30), IPv4 octets without leading zeros, UUIDs, e-mail
# addresses as dot-atoms at a hostname, RFC 3986 URIs and references (IP-literal hosts left
# out). Each admits only strings the format allows; none is wider.
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR_MINUTE = "(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = f"{_HOUR_MINUTE}:[0-5][0-9](?:\\.[0-9]{{1,9}})?(?:Z|[+-]{_HOUR_MINUTE})"


def _label(most: int, chars: str = "a-z0-9") -> str:
    return f"[{chars}](?:[{chars}-]{{0,{most - 2}}}[{chars}])?"


_HOSTNAME = (
    f"(?:{_label(63)}(?:\\.{_label(63)}){{0,2}}(?:\\.{_label(61)})?"
    f"|{_label(30)}(?:\\.{_label(30)}){{4,7}})"
)
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# RFC 5322's dot-atom local part (no quoted strings) at a hostname
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_DOMAIN_LABEL = _label(63, "A-Za-z0-9")
_EMAIL = f"{_ATOM}(?:\\.{_ATOM})*@{_DOMAIN_LABEL}(?:\\.{_DOMAIN_LABEL})*"
# RFC 3986 (IP-literal hosts left out): a URI, and a reference that may also be relative
_PCT = "%[0-9A-Fa-f]{2}"
_PCHAR = f"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})"
_NC_PCHAR = f"(?:[A-Za-z0-9._~!$&'()*+,;=@-]|{_PCT})"  # no colon: a relative path's start
_QUERY = f"(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_AUTHORITY = (
    f"//(?:(?:[A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*@)?(?:[A-Za-z0-9._~!$&'()*+,;=-]|{_PCT})*"
    f"(?::[0-9]*)?(?:/{_PCHAR}*)*"
)
_ABSOLUTE_PATH = f"/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?"
_URI = (
    f"[A-Za-z][A-Za-z0-9+.-]*:(?:{_AUTHORITY}|{_ABSOLUTE_PATH}|{_PCHAR}+(?:/{_PCHAR}*)*)?" + _QUERY
)
_RELATIVE = f"(?:{_AUTHORITY}|{_ABSOLUTE_PATH}|{_NC_PCHAR}+(?:/{_PCHAR}*)*)?{_QUERY}"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "hostname": f"^{_HOSTNAME}$",
    "ipv4": f"^{_OCTET}(?:\\.{_OCTET}){{3}}$",
    "uuid": "^[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$",
    "email": f"^{_EMAIL}$",
    "uri": f"^{_URI}$",
    "uri-reference": f"^(?:{_URI}|{_RELATIVE})$",
}
SUPPORTED_KEYWORDS = (
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
)
# Keywords that constrain what the engine cannot enforce. (`uniqueItems`,
# `unevaluatedProperties` and `format` are refused only for some values; see _features.)
UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "patternProperties",
    "propertyNames",
    "multipleOf",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedItems",
    "additionalItems",
    "$dynamicRef",
    "$recursiveRef",
    "minProperties",
    "maxProperties",
)
MAX_SCHEMA_DEPTH = 64  # nested subschemas; deeper is refused rather than risk the stack
_BOUND_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"))
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SOURCES = ("response_format", "guided_json", "structured_outputs")
_UNSUPPORTED_GUIDES = ("guided_regex", "guided_choice", "guided_grammar")
_UNSUPPORTED_OUTPUTS = ("regex", "choice", "grammar", "structural_tag")
_MAX_LISTED = 5  # further unsupported features named in one message


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the answer must be: free text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    schema: dict[str, Any] | None = None  # json_schema only
    name: str | None = None  # json_schema only
    strict: bool = False

    @property
    def is_constrained(self) -> bool:
        """Whether decoding must be constrained ("text" asks for nothing)."""
        return self.type != "text"


def parse_response_format(value: object, path: str = "response_format") -> ResponseFormat | None:
    """An OpenAI chat `response_format` — `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` —
    with its schema checked; None when absent."""
    if value is None:
        return None
    d = object_value(value, path)
    kind = string(d, "type", required=True, prefix=f"{path}.")
    if kind == "text":
        return ResponseFormat("text")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        fail(f"{path}.type", "'text', 'json_object' or 'json_schema'", kind)
    spec_path = f"{path}.json_schema"
    if d.get("json_schema") is None:
        raise invalid_request(f"{spec_path}: required when type is 'json_schema'", spec_path)
    spec = object_value(d["json_schema"], spec_path)
    p = f"{spec_path}."
    name = string(spec, "name", prefix=p) or "output"
    string(spec, "description", prefix=p)
    strict = boolean(spec, "strict", False, p)
    if spec.get("schema") is None:
        raise invalid_request(f"{p}schema: required when type is 'json_schema'", f"{p}schema")
    schema = object_value(spec["schema"], f"{p}schema")
    check_schema(schema, f"{p}schema")
    return ResponseFormat("json_schema", schema=schema, name=name, strict=strict)


def parse_request_format(d: dict[str, Any]) -> ResponseFormat | None:
    """The structured output a chat or completions body asks for through `response_format`,
    vLLM's `guided_json` (a schema or a JSON string of one) or `structured_outputs`
    (`{"json": ...}` or `{"json_object": true}`); at most one of them."""
    for key in _UNSUPPORTED_GUIDES:
        if d.get(key) is not None:
            raise invalid_request(
                f"{key}: not supported; ask for JSON with response_format or guided_json", key
            )
    given = [k for k in _SOURCES if d.get(k) is not None]
    if len(given) > 1:
        raise invalid_request(
            f"{given[1]}: give only one of {', '.join(given)} (they all constrain the output)",
            given[1],
        )
    if not given:
        return None
    if given[0] == "response_format":
        return parse_response_format(d["response_format"])
    if given[0] == "guided_json":
        return _json_schema_value(d["guided_json"], "guided_json")
    outputs = object_value(d["structured_outputs"], "structured_outputs")
    for key in _UNSUPPORTED_OUTPUTS:
        if outputs.get(key) is not None:
            raise invalid_request(
                f"structured_outputs.{key}: not supported; ask for JSON with "
                "structured_outputs.json",
                f"structured_outputs.{key}",
            )
    if outputs.get("json") is not None:
        return _json_schema_value(outputs["json"], "structured_outputs.json")
    if boolean(outputs, "json_object", False, "structured_outputs."):
        return ResponseFormat("json_object")
    return None


def _json_schema_value(value: object, path: str) -> ResponseFormat:
    """vLLM's guided JSON: a schema object, or a JSON string of one; enforced exactly."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise invalid_request(f"{path}: the schema is nested too deeply", path) from None
        except ValueError as e:
            message = f"{path}: expected a JSON schema, got invalid JSON: {e}"
            raise invalid_request(message, path) from None
    schema = object_value(value, path)
    check_schema(schema, path)
    return ResponseFormat("json_schema", schema=schema, name="output", strict=True)


# --- the schema check ------------------------------------------------------------------------


def check_schema(schema: dict[str, Any], path: str) -> None:
    """Raise the 400 `invalid_request_error` when `schema` is not a JSON schema (its `param`
    the offending field) or uses a feature the grammar engine cannot enforce (its `param` the
    subschema holding the first such feature; its message names each one and where)."""
    if not isinstance(schema, dict):
        fail(path, "a JSON schema object", schema)
    checker = _Checker(schema)
    checker.walk(schema, path, 0)
    while checker.refs:  # targets outside the tree walked so far (`#/components/...`)
        ref, ref_path, depth = checker.refs.pop()
        target = _resolve(schema, ref, ref_path)
        if isinstance(target, dict) and id(target) not in checker.seen:
            checker.walk(target, f"{path}{_pointer_path(ref)}", depth)
    if checker.unsupported:
        raise _unsupported(checker.unsupported)


class _Checker:
    """One walk over a schema: structural errors raise at once, unsupported features are
    collected so one message can name them all."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.seen: set[int] = set()
        self.refs: list[tuple[str, str, int]] = []
        self.unsupported: list[tuple[str, str]] = []  # (subschema path, feature)

    def walk(self, node: object, path: str, depth: int) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            fail(path, "a JSON schema (an object or a boolean)", node)
        if depth > MAX_SCHEMA_DEPTH:
            raise invalid_request(
                f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} subschemas", path
            )
        self.seen.add(id(node))
        self.unsupported += [(path, feature) for feature in _features(node)]
        _check_values(node, path)
        p, deeper = f"{path}.", depth + 1
        for key in ("properties", "$defs", "definitions"):
            children = node.get(key)
            if children is not None:
                for name, child in object_value(children, p + key).items():
                    self.walk(child, f"{p}{key}.{name}", deeper)
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            children = node.get(key)
            if children is None:
                continue
            if not isinstance(children, list) or (not children and key != "prefixItems"):
                fail(p + key, "a non-empty array of schemas", children)
            for i, child in enumerate(children):
                self.walk(child, f"{p}{key}[{i}]", deeper)
        if node.get("items") is not None and not isinstance(node["items"], list):
            self.walk(node["items"], p + "items", deeper)  # an array is refused in _features
        if node.get("additionalProperties") is not None:
            self.walk(node["additionalProperties"], p + "additionalProperties", deeper)
        ref = node.get("$ref")
        if ref is not None:
            if not isinstance(ref, str):
                fail(f"{p}$ref", "a string", ref)
            if ref.startswith("#"):
                _resolve(self.root, ref, f"{p}$ref")  # pointing nowhere is a 400 now
                self.refs.append((ref, f"{p}$ref", deeper))


def _features(node: dict[str, Any]) -> list[str]:
    """The features `node` itself uses that the engine cannot enforce, as they are named."""
    found = [repr(k) for k in UNSUPPORTED_KEYWORDS if k in node]
    if node.get("uniqueItems") is True:
        found.append("'uniqueItems': true")
    if "unevaluatedProperties" in node and node["unevaluatedProperties"] is not False:
        found.append("'unevaluatedProperties' other than false")
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        found.append(f"'format': {fmt!r}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        found.append(f"'allOf' with {len(node['allOf'])} subschemas")
    if isinstance(node.get("items"), list):
        found.append("'items' as an array")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"a remote '$ref' ({ref!r})")
    return found


def _check_values(node: dict[str, Any], path: str) -> None:
    """The keywords whose values are not subschemas have the types JSON Schema gives them."""
    p = f"{path}."
    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            fail(p + "type", f"one of {sorted(JSON_TYPES)} or a non-empty array of them", kind)
    required = node.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        fail(p + "required", "an array of property names", required)
    enum = node.get("enum")
    if enum is not None and not (isinstance(enum, list) and enum):
        fail(p + "enum", "a non-empty array", enum)
    for key in (k for pair in _BOUND_PAIRS for k in pair):
        value = node.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            fail(p + key, "a non-negative integer", value)
    for key in _NUMBERS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            fail(p + key, "a number", value)
    for low, high in (*_BOUND_PAIRS, ("minimum", "maximum")):
        if node.get(low) is not None and node.get(high) is not None and node[low] > node[high]:
            message = f"{p}{low}: {node[low]} is greater than {high} {node[high]}"
            raise invalid_request(message, p + low)
    for key in ("pattern", "format"):
        if node.get(key) is not None and not isinstance(node[key], str):
            fail(p + key, "a string", node[key])


def _resolve(root: dict[str, Any], ref: str, path: str) -> object:
    """The subschema a local `$ref` (`#`, `#/$defs/Name`) points at, or the 400."""
    if ref != "#" and not ref.startswith("#/"):
        raise invalid_request(
            f"{path}: {ref!r} is not a '#/...' JSON pointer (anchors are not supported)", path
        )
    try:
        node = ref_target(root, ref)
    except LookupError:
        raise invalid_request(f"{path}: {ref!r} points nowhere in the schema", path) from None
    if not isinstance(node, dict | bool):
        raise invalid_request(f"{path}: {ref!r} points at something that is not a schema", path)
    return node


def ref_target(root: dict[str, Any], ref: str) -> object:
    """What the local JSON pointer `ref` (`#`, `#/$defs/Name`, percent- and ~-escaped) names
    in `root`; LookupError when nothing does."""
    node: object = root
    for token in _pointer_tokens(ref):
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise LookupError(ref)
    return node


def _pointer_tokens(ref: str) -> list[str]:
    if ref == "#":
        return []
    return [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")]


def _pointer_path(ref: str) -> str:
    return "".join(f".{t}" for t in _pointer_tokens(ref))


def _unsupported(found: list[tuple[str, str]]) -> Exception:
    """The 400 naming every unsupported feature: those of the first subschema holding any
    (its path is the `param`), then a few of the others with theirs."""
    path = found[0][0]
    here = [f for p, f in found if p == path]
    message = f"{path}: {', '.join(here)} {'is' if len(here) == 1 else 'are'} not supported"
    message += " in structured output"
    elsewhere = [f"{f} at {p}" for p, f in found if p != path]
    if elsewhere:
        message += f"; nor {'; '.join(elsewhere[:_MAX_LISTED])}"
        if len(elsewhere) > _MAX_LISTED:
            message += f" and {len(elsewhere) - _MAX_LISTED} more"
    message += f" (supported: {', '.join(SUPPORTED_KEYWORDS)}"
    if any(f.startswith("'format'") for _, f in found):
        message += f"; formats: {', '.join(SUPPORTED_FORMATS)}"
    return invalid_request(message + ")", path)


__all__ = [
    "FORMAT_PATTERNS",
    "MAX_SCHEMA_DEPTH",
    "SUPPORTED_FORMATS",
    "SUPPORTED_KEYWORDS",
    "UNSUPPORTED_KEYWORDS",
    "ResponseFormat",
    "check_schema",
    "parse_request_format",
    "parse_response_format",
    "ref_target",
]
