"""The grammar a request's answer must match: structured output and constrained tool calls.

- `response_format` json_schema / json_object (chat, completions, Responses' `text.format`,
  Anthropic's `output_config` through the gateway): the answer is that JSON.
- tool_choice "required" or a named function, or tools marked `strict: true`: each call's
  body is constrained to its tool's `parameters`, written in the model's own format (Hermes
  JSON `{"name": …, "arguments": …}` or Qwen XML `<function=…><parameter=…>`), so it
  always parses; text outside the calls stays free ("auto" with strict tools), or there is
  none ("required": calls only, one after another; a named function: that one call).

Reasoning stays free: when the prompt leaves a reasoning block open the grammar starts with
free tokens up to its end marker; when the model may open one itself, an optional block.

Anything beyond a bare JSON answer is a Lark grammar for llguidance (docs/engine.md): the
markers are named by token id (`<[151657]>`: to llguidance an added token is a token, never
text), JSON bodies are `%json {...}`, and a Qwen XML call's parameters are spelled out one by
one as the template writes them (`<parameter=name>\\nvalue\\n</parameter>\\n`), strings raw
and held to their enum, pattern, format and length, other types as JSON.

Built on the node, off the event loop (in `prepare_prompt`); checked there with llguidance
without the vocabulary (a millisecond or two), so a schema it cannot build (a bad `pattern`)
is a 400 before the request is queued. The worker builds it for the vocabulary, once per
grammar.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from helexa.engine.grammar import ANY_OBJECT, GrammarError, OutputGrammar, check, json_options
from helexa.errors import invalid_request
from helexa.node.served import ServedModel
from helexa.protocol.openai import ChatCompletionRequest, CompletionRequest, Tool
from helexa.protocol.structured import FORMAT_PATTERNS, ResponseFormat, ref_target

PARAMETER_END = "\n</parameter>\n"


def output_grammar(
    served: ServedModel, req: ChatCompletionRequest | CompletionRequest, *, opens_reasoning: bool
) -> OutputGrammar | None:
    """The grammar of `req`'s answer on `served`, or None when it is free. Raises the 400
    when the grammar engine cannot build it."""
    try:
        grammar, param = _build(served, req, opens_reasoning)
    except GrammarError as e:  # found while writing the grammar (a Qwen XML parameter)
        message = f"tools: the grammar engine cannot enforce this: {e}"
        raise invalid_request(message, "tools") from None
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
        lark = _Lark(served)
        return lark.grammar(_reasoning(lark, req, opens), _calls(lark, req, tools)), "tools"
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None, ""
    if served.reasoning_markers is None or not (opens or req.wants_reasoning):
        return _json_grammar(fmt), "response_format"
    lark = _Lark(served)
    body = lark.rule("answer", _json(_schema_of(fmt)))
    return lark.grammar(_reasoning(lark, req, opens), body), "response_format"


def _json_grammar(fmt: ResponseFormat | None) -> OutputGrammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputGrammar("json_object")
    return OutputGrammar.json_schema(_schema_of(fmt))


def _schema_of(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object" or fmt.schema is None:
        return ANY_OBJECT
    return fmt.schema


def _json(schema: dict[str, Any] | bool, *, lenient: bool = False) -> str:
    """Lark's inline JSON schema, with the engine's options (bounded whitespace)."""
    return "%json " + json.dumps(json_options(schema, lenient=lenient), ensure_ascii=False)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


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


class _Lark:
    """A Lark grammar being written: numbered rules and terminals, markers by token id."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.lines: list[str] = []
        self._names: dict[str, int] = {}

    def _name(self, hint: str) -> str:
        n = self._names.get(hint, 0)
        self._names[hint] = n + 1
        return f"{hint}_{n}"

    def rule(self, hint: str, body: str, attrs: str = "") -> str:
        name = self._name(hint)
        self.lines.append(f"{name}{attrs}: {body}")
        return name

    def terminal(self, hint: str, body: str) -> str:
        name = self._name(hint.upper())
        self.lines.append(f"{name}: {body}")
        return name

    def token(self, text: str) -> str:
        """The marker `text` (a token of the vocabulary: markers are found there)."""
        token_id = self.served.tokenizer.token_to_id(text)
        assert token_id is not None, text
        return f"<[{token_id}]>"

    def tokens_but(self, *texts: str) -> str:
        """Any one token but `texts` and the stop tokens: free text that cannot end the
        answer or pass a marker."""
        ids = {self.served.tokenizer.token_to_id(t) for t in texts}
        ids |= set(self.served.tokenizer.eos_token_ids)
        return f"<[^{','.join(str(i) for i in sorted(i for i in ids if i is not None))}]>"

    def grammar(self, reasoning: str, body: str) -> OutputGrammar:
        start = f"{reasoning} {body}" if reasoning else body
        return OutputGrammar.lark("\n".join([f"start: {start}", *self.lines]) + "\n")


def _reasoning(lark: _Lark, req: ChatCompletionRequest, opens: bool) -> str:
    """What comes before the answer: the rest of a reasoning block the prompt opened, or an
    optional one the model opens itself (free tokens up to the end marker, then the blank
    lines a template puts after it); "" when the request does not reason."""
    markers = lark.served.reasoning_markers
    if markers is None or not (opens or req.wants_reasoning):
        return ""
    free = lark.rule("thought", f"{lark.tokens_but(markers.end)}*")
    rest = lark.rule("think_end", f'{free} {lark.token(markers.end)} "\\n"? "\\n"?')
    if opens:
        return rest
    return lark.rule("think", f"{lark.token(markers.start)} {rest}") + "?"


def _calls(lark: _Lark, req: ChatCompletionRequest, tools: list[Tool]) -> str:
    """The answer's calls, and the free text around them when calling is the model's choice."""
    markers = lark.served.tool_call_markers
    assert markers is not None
    forced = req.forced_tool
    if forced is not None and forced != "*":
        named = next(t for t in tools if t.name == forced)
        return _call(lark, named, lenient=not named.strict)
    strict_only = forced is None  # "auto": only strict tools are held to their schemas
    bodies = [
        _call(
            lark,
            t,
            lenient=not t.strict,
            schema=ANY_OBJECT if strict_only and not t.strict else None,
        )
        for t in tools
    ]
    call = lark.rule("call", " | ".join(bodies))
    if forced == "*":  # calls only, one after another as the template writes them
        return lark.rule("calls", f'{call} ("\\n" {call})*' if req.parallel_tool_calls else call)
    free = lark.rule("text", f"{lark.tokens_but(markers.start)}*")
    if req.parallel_tool_calls:
        return lark.rule("answer", f"{free} ({call} {free})*")
    return lark.rule("answer", f"{free} {call}?")


def _call(lark: _Lark, tool: Tool, *, lenient: bool, schema: dict[str, Any] | None = None) -> str:
    """One call of `tool`, markers included, in the format the model's template teaches."""
    markers = lark.served.tool_call_markers
    assert markers is not None
    params = schema if schema is not None else tool.parameters_schema
    start, end = lark.token(markers.start), lark.token(markers.end)
    if lark.served.teaches_xml_calls:
        head = _lit(f"\n<function={tool.name}>\n")
        body = _xml_parameters(lark, params, lenient)
        return lark.rule("call", f'{start} {head} {body} "</function>\\n" {end}')
    head = _lit('\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
    return lark.rule("call", f'{start} {head} {_json(params, lenient=lenient)} "}}\\n" {end}')


# -- Qwen XML parameters ------------------------------------------------------------------


def _xml_parameters(lark: _Lark, schema: dict[str, Any], lenient: bool) -> str:
    """The parameters of a Qwen XML call, in the schema's order, the required ones always
    there; any named parameters when the schema lists none."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        name = lark.terminal("param_name", r"/[A-Za-z_][A-Za-z0-9_.\-]*/")
        value = _free_string(lark)
        one = lark.rule("param", f'"<parameter=" {name} ">\\n" {value}')
        return f"{one}*"
    required = set(schema.get("required") or ())
    parts = []
    for key, sub in props.items():
        value = _xml_value(lark, schema, sub, lenient, f"properties.{key}")
        head = _lit(f"<parameter={key}>\n")
        one = lark.rule("param", f"{head} {value}")
        parts.append(one if key in required else f"{one}?")
    return " ".join(parts)


def _xml_value(lark: _Lark, root: dict[str, Any], schema: Any, lenient: bool, path: str) -> str:
    """A parameter's value and the line that closes it, as the template writes it: a
    string raw, anything else as JSON (`coerce_value` reads both back)."""
    branches = [
        _xml_branch(lark, root, b, lenient, path) for b in _branches(_resolve(root, schema))
    ]
    return lark.rule("value", " | ".join(dict.fromkeys(branches)))


def _xml_branch(lark: _Lark, root: dict[str, Any], schema: Any, lenient: bool, path: str) -> str:
    schema = _resolve(root, schema)
    if not _is_string(schema):
        defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
        body = {**schema, **defs} if isinstance(schema, dict) else schema
        return lark.rule("json_value", f"{_json(body, lenient=lenient)} {_lit(PARAMETER_END)}")
    shape = _string_shape(schema, lenient, path)
    if shape is None:
        return _free_string(lark)
    text = lark.terminal("string", shape)
    return lark.rule("string_value", f"{text} {_lit(PARAMETER_END)}")


def _free_string(lark: _Lark) -> str:
    """Any text up to the closing line (lazy: it ends at the first one)."""
    return lark.rule("free_value", f"/(?s:.*)/ {_lit(PARAMETER_END)}", "[lazy]")


def _resolve(root: dict[str, Any], schema: Any) -> Any:
    """`schema` with its local `$ref` followed (a few levels: a ref to a ref). A strict
    tool's refs were checked (`check_schema`); a lenient one's may point nowhere."""
    for _ in range(8):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        ref = schema["$ref"]
        try:
            node = ref_target(root, ref)
        except LookupError:
            raise GrammarError(f"{ref!r} points nowhere in the schema") from None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**node, **rest} if isinstance(node, dict) else node
    return schema


def _branches(schema: Any) -> list[Any]:
    """A union's alternatives: anyOf/oneOf, a list of types, an enum of several JSON types."""
    if not isinstance(schema, dict):
        return [schema]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            rest = {k: v for k, v in schema.items() if k != key}
            return [{**rest, **b} if isinstance(b, dict) else b for b in schema[key]]
    kinds = schema.get("type")
    if isinstance(kinds, list) and len(kinds) > 1:
        return [{**schema, "type": k} for k in kinds]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and not schema.get("type"):
        strings = [v for v in enum if isinstance(v, str)]
        others = [v for v in enum if not isinstance(v, str)]
        if strings and others:
            return [{**schema, "enum": strings}, {**schema, "enum": others}]
    return [schema]


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    for key in ("enum", "const"):
        if key in schema and schema.get("type") is None:
            values = schema[key] if key == "enum" else [schema[key]]
            return isinstance(values, list) and all(isinstance(v, str) for v in values)
    shaped = ("pattern", "format", "minLength", "maxLength")
    return schema.get("type") is None and any(k in schema for k in shaped)


def _string_shape(schema: dict[str, Any], lenient: bool, path: str) -> str | None:
    """A Lark terminal for a raw string parameter, or None when any text will do."""
    if isinstance(schema.get("enum"), list):
        return " | ".join(_lit(v) for v in schema["enum"] if isinstance(v, str))
    if isinstance(schema.get("const"), str):
        return _lit(schema["const"])
    parts = []
    if isinstance(schema.get("pattern"), str):
        parts.append(_regex(schema["pattern"]))
    fmt = schema.get("format")
    if isinstance(fmt, str):
        if fmt in FORMAT_PATTERNS:
            parts.append(_regex(FORMAT_PATTERNS[fmt]))
        elif not lenient:
            raise GrammarError(
                f"{path}: format {fmt!r} is not enforced in a Qwen XML call's parameter "
                f"(formats there: {', '.join(FORMAT_PATTERNS)})"
            )
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        parts.append(f"/(?s:.){{{low or 0},{high if isinstance(high, int) else ''}}}/")
    if not parts:
        return None
    # the value's text never holds the line that closes it
    parts.append(r"~/(?s:.*)\n<\/parameter>(?s:.*)/")
    return " & ".join(parts)


def _regex(pattern: str) -> str:
    """A JSON schema `pattern` (matched anywhere in the string, as JSON Schema says) as a
    Lark regex matching the whole of it."""
    import llguidance

    head = "" if pattern.startswith("^") else "(?s:.*)"
    body = pattern[1:] if pattern.startswith("^") else pattern
    anchored_end = body.endswith("$") and not body.endswith("\\$")
    tail = "" if anchored_end else "(?s:.*)"
    body = body[:-1] if anchored_end else body
    return f"/{head}(?:{llguidance.regex_to_lark(body, 'dw')}){tail}/"


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
