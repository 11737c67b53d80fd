"""Tool calls parsed out of model text: both body formats, repairs, coercion, and the
stream cut at every possible place."""

from __future__ import annotations

import json

import pytest

from helexa.engine.tokenizer import load_hf_tokenizer
from helexa.protocol.tool_calls import (
    ParsedCall,
    ToolCallMarkers,
    ToolCallSplitter,
    coerce_value,
    parse_tool_call_body,
    tool_schemas,
)
from tests.engine.tiny import FIXTURE_MODELS
from tests.shared_fixtures import needs_shared

MARKERS = ToolCallMarkers("<tool_call>", "</tool_call>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "score": {"type": "number"},
                    "maybe": {"type": ["integer", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "rename",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    },
]
SCHEMAS = tool_schemas(TOOLS)

XML_CALL = (
    "<tool_call>\n<function=search>\n<parameter=query>\nParis weather\n</parameter>\n"
    "<parameter=limit>\n5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
    '<parameter=filters>\n{"country": "FR"}\n</parameter>\n'
    "<parameter=score>\nhigh\n</parameter>\n</function>\n</tool_call>"
)


@needs_shared
def test_markers_come_from_the_vocabulary():
    qwen = load_hf_tokenizer(FIXTURE_MODELS / "Qwen3-0.6B")
    smol = load_hf_tokenizer(FIXTURE_MODELS / "SmolLM2-135M-Instruct")
    assert ToolCallMarkers.from_vocab(qwen) == MARKERS
    assert ToolCallMarkers.from_vocab(smol) is None


def test_a_hermes_json_body_parses():
    body = '{"name": "search", "arguments": {"query": "café ☕", "limit": 3}}'
    assert parse_tool_call_body(body, SCHEMAS) == ParsedCall(
        "search", {"query": "café ☕", "limit": 3}
    )


def test_json_slips_are_repaired():
    extra_braces = '{"name": "search", "arguments": {"query": "x"}}}}'
    assert parse_tool_call_body(extra_braces, SCHEMAS) == ParsedCall("search", {"query": "x"})
    nested_name = '{"arguments": {"name": "search", "query": "x"}}'
    assert parse_tool_call_body(nested_name, SCHEMAS) == ParsedCall("search", {"query": "x"})
    string_args = '{"name": "search", "arguments": "{\\"limit\\": 2}"}'
    assert parse_tool_call_body(string_args, SCHEMAS) == ParsedCall("search", {"limit": 2})
    stringly_typed = '{"name": "search", "arguments": {"limit": "7"}}'
    assert parse_tool_call_body(stringly_typed, SCHEMAS) == ParsedCall("search", {"limit": 7})


def test_a_name_parameter_is_not_mistaken_for_the_tool_name():
    body = '{"name": "rename", "arguments": {"name": "new.txt"}}'
    assert parse_tool_call_body(body, SCHEMAS) == ParsedCall("rename", {"name": "new.txt"})


def test_qwen_xml_values_are_coerced_to_their_declared_types():
    body = XML_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    call = parse_tool_call_body(body, SCHEMAS)
    assert call == ParsedCall(
        "search",
        {
            "query": "Paris weather",
            "limit": 5,
            "exact": True,
            "filters": {"country": "FR"},
            "score": "high",  # mistyped: kept as the string, never dropped
        },
    )


@pytest.mark.parametrize(
    ("raw", "schema", "expected"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),
        ("2.5", {"type": "number"}, 2.5),
        ("nan", {"type": "number"}, "nan"),
        ("FALSE", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": ["integer", "null"]}, None),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("{'a': True}", {"type": "object"}, {"a": True}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        (" spaced ", {"type": "string"}, " spaced "),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
        ("3", {"enum": [1, 2, 3]}, 3),
        ("3", {}, "3"),
    ],
)
def test_coercion_follows_the_schema_and_falls_back_to_the_string(raw, schema, expected):
    assert coerce_value(raw, schema) == expected


def test_an_undeclared_tool_reads_values_for_what_they_look_like():
    body = "<function=other>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhi\n</parameter>"
    assert parse_tool_call_body(body, SCHEMAS) == ParsedCall("other", {"n": 3, "s": "hi"})


@pytest.mark.parametrize("body", ["", "   ", "not json", "{broken", '{"arguments": {}}', "[1]"])
def test_unparseable_bodies_are_none(body):
    assert parse_tool_call_body(body, SCHEMAS) is None


def _run(text: str, cuts: list[int]) -> list[str | ParsedCall]:
    splitter = ToolCallSplitter(MARKERS, SCHEMAS)
    out: list[str | ParsedCall] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out += splitter.feed(text[a:b])
    out += splitter.flush()
    merged: list[str | ParsedCall] = []
    for part in out:  # adjacent text pieces are one piece
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return merged


TWO_CALLS = (
    'Let me look. <tool_call>\n{"name": "search", "arguments": {"query": "a 🌍"}}\n</tool_call>\n'
    + XML_CALL
)


@pytest.mark.parametrize("cut", range(1, len(TWO_CALLS)))
def test_a_stream_cut_anywhere_gives_the_same_calls(cut):
    assert _run(TWO_CALLS, [cut]) == _run(TWO_CALLS, [])


def test_two_calls_in_one_turn_come_out_in_order_with_the_text_before_them():
    parts = _run(TWO_CALLS, [])
    assert parts[0] == "Let me look. "
    calls = [p for p in parts if isinstance(p, ParsedCall)]
    assert [c.name for c in calls] == ["search", "search"]
    assert calls[0].arguments == {"query": "a 🌍"}
    assert json.loads(calls[0].arguments_json) == {"query": "a 🌍"}


def test_one_character_at_a_time_never_leaks_markup_as_text():
    parts = _run(TWO_CALLS, list(range(1, len(TWO_CALLS))))
    text = "".join(p for p in parts if isinstance(p, str))
    assert "<tool_call>" not in text and "function=" not in text


def test_a_garbage_body_comes_back_as_text():
    text = "Sure. <tool_call>call search now!</tool_call> done"
    assert _run(text, [9, 20]) == ["Sure. <tool_call>call search now!</tool_call> done"]


def test_an_unclosed_block_at_the_end_is_parsed_if_it_can_be_else_text():
    assert _run('<tool_call>{"name": "search", "arguments": {}}', []) == [ParsedCall("search", {})]
    assert _run("<tool_call>{half", []) == ["<tool_call>{half"]


def test_an_empty_block_is_nothing():
    assert _run("a<tool_call>\n</tool_call>b", []) == ["ab"]


def test_a_partial_start_marker_at_the_end_is_text():
    assert _run("x <tool_ca", []) == ["x <tool_ca"]


def test_a_call_begun_in_the_prompt_is_continued_by_the_answer():
    splitter = ToolCallSplitter(MARKERS, SCHEMAS, call_prefix='\n{"name": "search", "arguments": ')
    parts = splitter.feed('{"limit": "4"}}\n</tool_call>') + splitter.flush()
    assert parts == [ParsedCall("search", {"limit": 4})]
