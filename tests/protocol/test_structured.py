"""Structured-output requests: every route's way of asking parses into one ResponseFormat,
and a schema the grammar engine cannot enforce is a 400 naming the feature and where."""

from __future__ import annotations

import enum
import json
from typing import Any, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from helexa.errors import HelexaError
from helexa.protocol.anthropic import to_openai_chat
from helexa.protocol.openai import parse_chat_request, parse_completion_request
from helexa.protocol.responses import parse_responses_request
from helexa.protocol.structured import (
    MAX_SCHEMA_DEPTH,
    SUPPORTED_FORMATS,
    UNSUPPORTED_KEYWORDS,
    ResponseFormat,
    check_schema,
    parse_response_format,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **overrides}


def _completion(**overrides: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **overrides}


def _json_schema(schema: object, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


def _refused(call: Any, *args: Any, **kwargs: Any) -> HelexaError:
    with pytest.raises(HelexaError) as info:
        call(*args, **kwargs)
    error = info.value
    assert (error.status, error.type) == (400, "invalid_request_error")
    assert error.param is not None and error.message.startswith(error.param)
    return error


# --- the OpenAI shapes -----------------------------------------------------------------------


def test_every_chat_response_format_shape_parses_into_a_response_format() -> None:
    parse = parse_response_format
    assert parse(None) is None
    assert parse({"type": "text"}) == ResponseFormat("text")
    assert not ResponseFormat("text").is_constrained
    assert parse({"type": "json_object"}) == ResponseFormat("json_object")
    full = _json_schema(PERSON, strict=True, description="a person")
    assert parse(full) == ResponseFormat("json_schema", PERSON, "person", strict=True)
    nameless = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    assert parse(nameless) == ResponseFormat("json_schema", PERSON, "output", strict=False)


def test_chat_and_completions_carry_a_typed_response_format() -> None:
    chat = parse_chat_request(_chat(response_format=_json_schema(PERSON, strict=True)))
    assert chat.response_format == ResponseFormat("json_schema", PERSON, "person", True)
    completion = parse_completion_request(_completion(response_format={"type": "json_object"}))
    assert completion.response_format == ResponseFormat("json_object")
    assert parse_chat_request(_chat()).response_format is None
    assert parse_completion_request(_completion()).response_format is None


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": PERSON},
        {"guided_json": json.dumps(PERSON)},
        {"structured_outputs": {"json": PERSON}},
        {"structured_outputs": {"json": json.dumps(PERSON), "disable_any_whitespace": True}},
    ],
    ids=["guided_json", "guided_json string", "structured_outputs", "structured_outputs string"],
)
def test_vllm_guided_json_forms_are_a_strict_json_schema_on_both_routes(
    parse: Any, fields: dict[str, Any]
) -> None:
    body = _chat(**fields) if parse is parse_chat_request else _completion(**fields)
    assert parse(body).response_format == ResponseFormat("json_schema", PERSON, "output", True)


def test_structured_outputs_json_object_is_json_mode() -> None:
    req = parse_completion_request(_completion(structured_outputs={"json_object": True}))
    assert req.response_format == ResponseFormat("json_object")


BAD_REQUESTS = [
    ("not an object", {"response_format": "json"}, "response_format"),
    ("no type", {"response_format": {}}, "response_format.type"),
    ("unknown type", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "json_schema missing",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "json_schema not an object",
        {"response_format": {"type": "json_schema", "json_schema": "x"}},
        "response_format.json_schema",
    ),
    (
        "no schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        "schema a boolean",
        {"response_format": _json_schema(True)},
        "response_format.json_schema.schema",
    ),
    (
        "name a number",
        {"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        "strict a string",
        {"response_format": _json_schema({}, strict="yes")},
        "response_format.json_schema.strict",
    ),
    (
        "a bad schema",
        {"response_format": _json_schema({"type": "object", "properties": []})},
        "response_format.json_schema.schema.properties",
    ),
    ("guided_json a number", {"guided_json": 5}, "guided_json"),
    ("guided_json not JSON", {"guided_json": "{'type': 'object'}"}, "guided_json"),
    ("guided_json a JSON array", {"guided_json": "[1]"}, "guided_json"),
    (
        "guided_json unsupported",
        {"guided_json": {"type": "integer", "multipleOf": 2}},
        "guided_json",
    ),
    ("structured_outputs a list", {"structured_outputs": []}, "structured_outputs"),
    (
        "structured_outputs regex",
        {"structured_outputs": {"regex": "a+"}},
        "structured_outputs.regex",
    ),
    ("guided_regex", {"guided_regex": "a+"}, "guided_regex"),
    ("guided_choice", {"guided_choice": ["a", "b"]}, "guided_choice"),
    (
        "response_format and guided_json",
        {"response_format": {"type": "json_object"}, "guided_json": PERSON},
        "guided_json",
    ),
    (
        "guided_json and structured_outputs",
        {"guided_json": PERSON, "structured_outputs": {"json": PERSON}},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(
    ("case", "fields", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_bad_structured_output_request_is_a_400_naming_the_field(
    route: str, case: str, fields: dict[str, Any], param: str
) -> None:
    if route == "chat":
        error = _refused(parse_chat_request, _chat(**fields))
    else:
        error = _refused(parse_completion_request, _completion(**fields))
    assert error.param == param


def test_asking_twice_names_both_fields() -> None:
    error = _refused(parse_chat_request, _chat(response_format={"type": "text"}, guided_json={}))
    assert "response_format" in error.message and "guided_json" in error.message


# --- the schema check: what is refused -------------------------------------------------------

UNSUPPORTED = [
    *[
        (keyword, {"type": "string", keyword: {}}, repr(keyword))
        for keyword in UNSUPPORTED_KEYWORDS
    ],
    ("uniqueItems true", {"type": "array", "uniqueItems": True}, "'uniqueItems': true"),
    (
        "unevaluatedProperties a schema",
        {"type": "object", "unevaluatedProperties": {"type": "string"}},
        "'unevaluatedProperties' other than false",
    ),
    ("an unlisted format", {"type": "string", "format": "ipv5"}, "'format': 'ipv5'"),
    ("allOf of two", {"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with 2"),
    ("items as an array", {"type": "array", "items": [{"type": "string"}]}, "'items' as an array"),
    ("a remote $ref", {"$ref": "https://example.com/s.json"}, "a remote '$ref'"),
]


@pytest.mark.parametrize(
    ("case", "subschema", "feature"), UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED]
)
def test_an_unsupported_feature_is_a_400_naming_it_and_where(
    case: str, subschema: dict[str, Any], feature: str
) -> None:
    schema = {"type": "object", "properties": {"age": subschema}}
    error = _refused(check_schema, schema, "response_format.json_schema.schema")
    assert error.param == "response_format.json_schema.schema.properties.age"
    assert error.message.startswith(f"{error.param}: {feature}")
    assert "not supported in structured output (supported: type, properties" in error.message


def test_an_unlisted_format_lists_the_formats_that_are() -> None:
    error = _refused(check_schema, {"type": "string", "format": "binary"}, "s")
    assert f"formats: {', '.join(SUPPORTED_FORMATS)}" in error.message


@pytest.mark.parametrize(
    ("where", "schema"),
    [
        ("items", {"type": "array", "items": {"not": {}}}),
        ("prefixItems[1]", {"type": "array", "prefixItems": [{}, {"not": {}}]}),
        ("additionalProperties", {"type": "object", "additionalProperties": {"not": {}}}),
        ("anyOf[0]", {"anyOf": [{"not": {}}, {"type": "null"}]}),
        ("oneOf[1]", {"oneOf": [{"type": "null"}, {"not": {}}]}),
        ("allOf[0]", {"allOf": [{"not": {}}]}),
        ("$defs.A", {"$defs": {"A": {"not": {}}}}),
        ("definitions.A", {"definitions": {"A": {"not": {}}}}),
        (
            "properties.a.items.properties.b",
            {"properties": {"a": {"items": {"properties": {"b": {"not": {}}}}}}},
        ),
        ("components.X", {"$ref": "#/components/X", "components": {"X": {"not": {}}}}),
    ],
)
def test_the_check_walks_every_subschema(where: str, schema: dict[str, Any]) -> None:
    assert _refused(check_schema, schema, "s").param == f"s.{where}"


def test_every_unsupported_feature_is_named_in_one_message() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "multipleOf": 2, "not": {"const": 3}},
            "b": {"type": "array", "uniqueItems": True},
            "c": {"type": "string", "format": "ipv5"},
        },
    }
    error = _refused(check_schema, schema, "s")
    assert error.param == "s.properties.a"
    assert error.message.startswith("s.properties.a: 'not', 'multipleOf' are not supported")
    assert "'uniqueItems': true at s.properties.b" in error.message
    assert "'format': 'ipv5' at s.properties.c" in error.message


NOT_A_SCHEMA = [
    ("a string", "object", "s"),
    ("a subschema a number", {"properties": {"a": 5}}, "s.properties.a"),
    ("type unknown", {"type": "str"}, "s.type"),
    ("type an empty list", {"type": []}, "s.type"),
    ("type a list with junk", {"type": ["string", 1]}, "s.type"),
    ("properties a list", {"properties": [{"a": {}}]}, "s.properties"),
    ("required a string", {"required": "a"}, "s.required"),
    ("required holding a number", {"required": ["a", 1]}, "s.required"),
    ("enum empty", {"enum": []}, "s.enum"),
    ("enum a string", {"enum": "a"}, "s.enum"),
    ("minLength negative", {"minLength": -1}, "s.minLength"),
    ("maxItems a float", {"maxItems": 1.5}, "s.maxItems"),
    ("minItems a boolean", {"minItems": True}, "s.minItems"),
    ("minLength over maxLength", {"minLength": 5, "maxLength": 2}, "s.minLength"),
    ("minItems over maxItems", {"minItems": 3, "maxItems": 1}, "s.minItems"),
    ("minimum over maximum", {"minimum": 3, "maximum": 1}, "s.minimum"),
    ("minimum a string", {"minimum": "0"}, "s.minimum"),
    ("pattern a number", {"pattern": 5}, "s.pattern"),
    ("anyOf empty", {"anyOf": []}, "s.anyOf"),
    ("oneOf an object", {"oneOf": {}}, "s.oneOf"),
    ("$ref pointing nowhere", {"$ref": "#/$defs/Missing"}, "s.$ref"),
    ("$ref into a missing array index", {"anyOf": [{}], "$ref": "#/anyOf/3"}, "s.$ref"),
    (
        "$ref at a non-schema",
        {"title": "t", "properties": {"a": {"$ref": "#/title"}}},
        "s.properties.a.$ref",
    ),
    ("$ref an anchor", {"$ref": "#node"}, "s.$ref"),
    ("$ref a number", {"$ref": 5}, "s.$ref"),
]


@pytest.mark.parametrize(
    ("case", "schema", "param"), NOT_A_SCHEMA, ids=[c[0] for c in NOT_A_SCHEMA]
)
def test_what_is_not_a_json_schema_is_a_400_naming_the_field(
    case: str, schema: Any, param: str
) -> None:
    assert _refused(check_schema, schema, "s").param == param


def test_a_schema_nested_too_deeply_is_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        schema = {"type": "array", "items": schema}
    assert "deeper than" in _refused(check_schema, schema, "s").message


# --- the schema check: what is accepted ------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": ["string", "null"], "nullable": True},
        # a pattern or format with length bounds, or both: the grammar holds all of them
        {"type": "string", "format": "date-time", "minLength": 0, "maxLength": 0},
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
        {"type": "string", "format": "email", "maxLength": 64},
        {"type": "string", "format": "date", "pattern": "^2"},
        *[{"type": "string", "format": f} for f in SUPPORTED_FORMATS],
        {"type": "array", "uniqueItems": False, "minItems": 1, "maxItems": 1},
        {"type": "object", "unevaluatedProperties": False, "additionalProperties": True},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1.5},
        {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "object"}}},
        {"properties": {"a": True, "b": False}, "additionalProperties": False},
        {"enum": ["a", 1, None], "const": "a"},
        {"type": "array", "prefixItems": [], "items": False},
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "urn:x",
            "$comment": "c",
            "title": "T",
            "description": "d",
            "default": {},
            "examples": [{}],
            "deprecated": False,
            "readOnly": True,
            "writeOnly": False,
            "x-vendor": 1,
        },
        {"definitions": {"a/b~c": {"type": "string"}}, "$ref": "#/definitions/a~1b~0c"},
        {"$defs": {"A B": {"type": "string"}}, "$ref": "#/$defs/A%20B"},
    ],
)
def test_supported_schemas_pass_the_check(schema: dict[str, Any]) -> None:
    check_schema(schema, "s")


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=50, description="their name")
    age: int = Field(ge=0, le=150)
    color: Color
    tags: list[str]
    nickname: Optional[str] = None  # noqa: UP045 (pydantic users write both)
    home: Address
    work: Address | None = None
    pair: tuple[int, str]
    scores: dict[str, float]
    kind: Literal["person"] = "person"


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    good: bool


class Tree(BaseModel):
    label: str
    children: list[Tree] = []
    pet: Cat | Dog = Field(discriminator="pet_type")


@pytest.mark.parametrize("model", [Person, Tree])
def test_pydantic_generated_schemas_are_accepted_on_every_route(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    check_schema(schema, "s")
    req = parse_chat_request(_chat(response_format=_json_schema(schema, strict=True)))
    assert req.response_format == ResponseFormat("json_schema", schema, "person", True)
    body = {
        "model": "m",
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "p", "schema": schema}},
    }
    assert parse_responses_request(body).chat.response_format.schema == schema
    anthropic = _anthropic(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert anthropic["response_format"]["json_schema"]["schema"] == schema


# --- tools -----------------------------------------------------------------------------------


def _tool(name: str, parameters: Any = None, **function: Any) -> dict[str, Any]:
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": {"name": name, **function}}


BAD_PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}


def test_a_strict_tool_has_its_parameters_checked_and_a_loose_one_does_not() -> None:
    req = parse_chat_request(_chat(tools=[_tool("a", BAD_PARAMETERS), _tool("b", strict=True)]))
    assert [t.strict for t in req.tools] == [False, True]
    assert req.tools[1].parameters is None
    assert req.tools[1].parameters_schema == {"type": "object", "properties": {}}
    body = _chat(tools=[_tool("a", PERSON), _tool("b", BAD_PARAMETERS, strict=True)])
    error = _refused(parse_chat_request, body)
    assert error.param == "tools[1].function.parameters.properties.n"
    assert "'multipleOf'" in error.message


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "a"}}], ids=str
)
def test_a_forced_tool_that_is_not_strict_is_not_refused_for_its_schema(choice: Any) -> None:
    # agents' tools use propertyNames and the like: the engine holds calls to what it can
    req = parse_chat_request(_chat(tools=[_tool("a", BAD_PARAMETERS)], tool_choice=choice))
    assert req.forced_tool in ("*", "a") and not req.tools[0].strict


def test_a_strict_flag_that_is_not_a_boolean_is_a_400() -> None:
    error = _refused(parse_chat_request, _chat(tools=[_tool("a", strict="yes")]))
    assert error.param == "tools[0].function.strict"


# --- Responses -------------------------------------------------------------------------------


def _responses(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


@pytest.mark.parametrize(
    ("text_format", "expected"),
    [
        (None, None),
        ({"type": "text"}, ResponseFormat("text")),
        ({"type": "json_object"}, ResponseFormat("json_object")),
        (
            {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True},
            ResponseFormat("json_schema", PERSON, "person", True),
        ),
        (
            {"type": "json_schema", "schema": PERSON, "description": "d"},
            ResponseFormat("json_schema", PERSON, "output", False),
        ),
    ],
)
def test_responses_text_format_becomes_the_chat_response_format(
    text_format: dict[str, Any] | None, expected: ResponseFormat | None
) -> None:
    text = {"verbosity": "low"} if text_format is None else {"format": text_format}
    parsed = parse_responses_request(_responses(text=text))
    assert parsed.chat.response_format == expected
    assert parsed.echo["text"] == text


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ("json", "text"),
        ({"format": "json"}, "text.format"),
        ({"format": {"type": "xml"}}, "text.format.type"),
        ({"format": {"type": "json_schema", "name": "p"}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "schema": PERSON, "strict": 1}}, "text.format.strict"),
        (
            {"format": {"type": "json_schema", "schema": {"properties": {"a": {"not": {}}}}}},
            "text.format.schema.properties.a",
        ),
    ],
)
def test_a_bad_responses_text_format_is_a_400_naming_the_responses_field(
    text: object, param: str
) -> None:
    error = _refused(parse_responses_request, _responses(text=text))
    assert error.param == param
    assert "response_format" not in error.message


def test_responses_function_tools_carry_strict_and_name_their_own_index() -> None:
    web = {"type": "web_search"}
    loose = {"type": "function", "name": "f", "parameters": PERSON}
    strict = {"type": "function", "name": "g", "parameters": PERSON, "strict": True}
    chat = parse_responses_request(_responses(tools=[web, loose, strict])).chat
    assert [(t.name, t.strict) for t in chat.tools] == [("f", False), ("g", True)]
    bad = {"type": "function", "name": "g", "parameters": BAD_PARAMETERS, "strict": True}
    error = _refused(parse_responses_request, _responses(tools=[web, bad]))
    assert error.param == "tools[1].parameters.properties.n"


# --- Anthropic -------------------------------------------------------------------------------


def _anthropic(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    return to_openai_chat({**body, **fields}).body


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_output_format_becomes_a_strict_json_schema(field: str) -> None:
    spec = {"type": "json_schema", "schema": PERSON}
    body = _anthropic(**{field: {"format": spec} if field == "output_config" else spec})
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": PERSON, "strict": True},
    }
    req = parse_chat_request(body)
    assert req.response_format == ResponseFormat("json_schema", PERSON, "output", True)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"output_config": {"format": {"type": "json_schema", "schema": BAD_PARAMETERS}}},
            "output_config.format.schema.properties.n",
        ),
        (
            {"output_format": {"type": "json_schema", "schema": BAD_PARAMETERS}},
            "output_format.schema.properties.n",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": []}}},
            "output_config.format.schema",
        ),
    ],
)
def test_an_anthropic_schema_the_engine_cannot_enforce_is_a_400(
    fields: dict[str, Any], param: str
) -> None:
    assert _refused(_anthropic, **fields).param == param


def test_anthropic_strict_tools_carry_strict_and_are_checked() -> None:
    server = {"type": "web_search_20250305", "name": "web_search"}
    loose = {"name": "a", "input_schema": BAD_PARAMETERS}
    strict = {"name": "b", "input_schema": PERSON, "strict": True}
    body = _anthropic(tools=[server, loose, strict])
    assert [t["function"].get("strict") for t in body["tools"]] == [None, True]
    assert parse_chat_request(body).tools[1].strict
    bad = {"name": "b", "input_schema": BAD_PARAMETERS, "strict": True}
    assert _refused(_anthropic, tools=[server, bad]).param == "tools[1].input_schema.properties.n"


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "a"}], ids=["any", "tool"]
)
def test_anthropic_forced_tools_that_are_not_strict_are_not_refused(choice: Any) -> None:
    body = _anthropic(tools=[{"name": "a", "input_schema": BAD_PARAMETERS}], tool_choice=choice)
    assert parse_chat_request(body).forced_tool in ("*", "a")
