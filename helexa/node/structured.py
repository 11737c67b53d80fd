"""The grammar a request's answer must match: structured output and constrained tool calls.

- `response_format` json_schema / json_object (chat, completions, Responses' `text.format`,
  Anthropic's `output_config` through the gateway): the answer is that JSON.
- tool_choice "required" or a named function, or tools marked `strict: true`: each call's
  body is constrained to its tool's `parameters`, written in the model's own format (Hermes
  JSON `{"name": …, "arguments": …}` or Qwen XML `<function=…><parameter=…>`), so it
  always parses; text outside the calls stays free ("auto" with strict tools), or there is
  none ("required": calls only; a named function: that one call).

Reasoning stays free: when the prompt leaves a reasoning block open the grammar starts with
free text up to its end marker; when the model may open one itself, an optional block.

Built on the node, off the event loop (in `prepare_prompt`); checked there with xgrammar
without the vocabulary (cheap), so a schema xgrammar cannot build (a bad `pattern`) is a 400
before the request is queued. The worker compiles it for the vocabulary, once per grammar.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from helexa.engine.grammar import (
    ANY_OBJECT,
    MAX_JSON_WHITESPACE,
    GrammarError,
    OutputGrammar,
    check,
    json_safe,
)
from helexa.errors import invalid_request
from helexa.node.served import ServedModel
from helexa.protocol.openai import ChatCompletionRequest, CompletionRequest, Tool
from helexa.protocol.structured import ResponseFormat


def output_grammar(
    served: ServedModel, req: ChatCompletionRequest | CompletionRequest, *, opens_reasoning: bool
) -> OutputGrammar | None:
    """The grammar of `req`'s answer on `served`, or None when it is free. Raises the 400
    when xgrammar cannot build it."""
    grammar, param = _build(served, req, opens_reasoning)
    if grammar is not None:
        _checked(grammar, param)
    return grammar


def _build(
    served: ServedModel, req: ChatCompletionRequest | CompletionRequest, opens: bool
) -> tuple[OutputGrammar | None, str]:
    if isinstance(req, CompletionRequest):
        return _json_grammar(req.response_format), "response_format"
    tools = _constrained_tools(served, req)
    if tools is not None:
        body = _tool_calls(served, req, tools)
        return _with_reasoning(served, req, body, opens), "tools"
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None, ""
    json_format: dict[str, Any] = {"type": "json_schema", "json_schema": json_safe(_schema_of(fmt))}
    json_format["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
    if served.reasoning_markers is None or not (opens or req.wants_reasoning):
        return _json_grammar(fmt), "response_format"
    return _with_reasoning(served, req, json_format, opens), "response_format"


def _json_grammar(fmt: ResponseFormat | None) -> OutputGrammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputGrammar("json_object")
    return OutputGrammar.json_schema(_schema_of(fmt))


def _schema_of(fmt: ResponseFormat) -> dict[str, Any] | bool:
    if fmt.type == "json_object" or fmt.schema is None:
        return ANY_OBJECT
    return fmt.schema


def _constrained_tools(served: ServedModel, req: ChatCompletionRequest) -> list[Tool] | None:
    """The tools whose calls are constrained, or None when no call is: tool_choice
    "required" or a named function constrains every offered tool; "auto" those marked
    strict (the others' bodies stay any JSON object). Needs the model's call markers."""
    if served.tool_call_markers is None or not req.tools or req.tool_choice == "none":
        return None
    if req.forced_tool is not None:
        return req.tools
    if any(t.strict for t in req.tools):
        return req.tools
    return None


def _tool_calls(
    served: ServedModel, req: ChatCompletionRequest, tools: list[Tool]
) -> dict[str, Any]:
    """The structural-tag format of the answer's calls (and of the free text around them)."""
    markers = served.tool_call_markers
    assert markers is not None
    forced = req.forced_tool
    strict_only = forced is None  # "auto": only strict tools are held to their schemas

    def tag(tool: Tool) -> dict[str, Any]:
        schema = tool.parameters if tool.parameters is not None else {"type": "object"}
        if strict_only and not tool.strict:
            schema = ANY_OBJECT
        if served.teaches_xml_calls:
            return {
                "type": "tag",
                "begin": f"{markers.start}\n<function={tool.name}>\n",
                "content": {
                    "type": "json_schema",
                    "json_schema": json_safe(schema),
                    "style": "qwen_xml",
                    "max_whitespace_cnt": MAX_JSON_WHITESPACE,
                },
                "end": f"</function>\n{markers.end}",
            }
        name = json.dumps(tool.name, ensure_ascii=False)
        return {
            "type": "tag",
            "begin": f'{markers.start}\n{{"name": {name}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": json_safe(schema),
                "max_whitespace_cnt": MAX_JSON_WHITESPACE,
            },
            "end": f"}}\n{markers.end}",
        }

    if forced is not None and forced != "*":
        named = next(t for t in tools if t.name == forced)
        return tag(named)
    if forced == "*":  # calls only, one after another as the template writes them
        return {
            "type": "tags_with_separator",
            "tags": [tag(t) for t in tools],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not req.parallel_tool_calls,
        }
    return {  # free text, each call it opens held to its tool's schema
        "type": "triggered_tags",
        "triggers": [markers.start],
        "tags": [tag(t) for t in tools],
        "at_least_one": False,
        "stop_after_first": not req.parallel_tool_calls,
    }


def _with_reasoning(
    served: ServedModel, req: ChatCompletionRequest, body: dict[str, Any], opens: bool
) -> OutputGrammar:
    """`body` after the reasoning the model may write first, left free: the rest of an open
    block (the prompt opened it), or an optional block the model opens itself."""
    reasoning = served.reasoning_markers
    elements = []
    if reasoning is not None and (opens or req.wants_reasoning):
        block = {
            "type": "tag",
            "begin": "" if opens else reasoning.start,
            "content": {"type": "any_text"},
            "end": [f"{reasoning.end}\n\n", f"{reasoning.end}\n", reasoning.end],
        }
        elements.append(block if opens else {"type": "optional", "content": block})
    elements.append(body)
    fmt = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return OutputGrammar.structural_tag({"type": "structural_tag", "format": fmt})


def _checked(grammar: OutputGrammar, param: str) -> None:
    try:
        _check_cached(grammar)
    except GrammarError as e:
        raise invalid_request(
            f"{param}: the grammar engine cannot enforce this schema: {e}", param
        ) from None


@functools.lru_cache(maxsize=512)
def _check_cached(grammar: OutputGrammar) -> None:
    check(grammar)
