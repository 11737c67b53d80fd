"""The Anthropic ↔ OpenAI translation, without HTTP: requests, whole answers, the stream
state machine, and properties over random conversations and random chunkings."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helexa.errors import HelexaError, context_length_exceeded
from helexa.protocol.anthropic import to_openai_chat, tokenize_body
from helexa.protocol.anthropic_out import StreamTranslator, error_body, from_openai_chat
from helexa.protocol.wire import SSEReader, sse_event
from tests.gateway.anthropic_events import assert_well_formed, parse_events


def _translate(**body) -> dict:
    return to_openai_chat({"model": "m", "max_tokens": 10, **body}).body


# -- requests -------------------------------------------------------------------------------


def test_the_system_prompt_and_every_system_turn_become_one_first_system_message():
    body = _translate(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.6e2;"},
            {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Agents: none."},
            {"role": "assistant", "content": "Hello"},
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Bye"},
        ],
    )
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    # the billing header changes with every prompt: it would defeat the prefix cache
    assert body["messages"][0]["content"] == "You are helpful.\n\nAgents: none.\n\nBe brief."


def test_tool_results_become_tool_messages_before_the_user_s_own_words():
    body = _translate(
        messages=[
            {"role": "user", "content": "List files"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "ls it", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"c": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "denied", "cache_control": {}}],
                    },
                ],
            },
        ]
    )
    _, assistant, first, second, words = body["messages"]
    assert assistant == {
        "role": "assistant",
        "content": "Looking.",
        "reasoning_content": "ls it",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"c": "ls"}'},
            },
            {"id": "toolu_2", "type": "function", "function": {"name": "Read", "arguments": "{}"}},
        ],
    }
    assert first == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"}
    assert second == {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: denied"}
    assert words == {"role": "user", "content": "Here:"}


def test_images_become_data_uri_parts_and_follow_a_tool_result_that_carried_them():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBOR"}
    body = _translate(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "image", "source": png}],
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
                    {"type": "text", "text": "What are these?"},
                ],
            }
        ]
    )
    tool, user = body["messages"]
    assert tool == {"role": "tool", "tool_call_id": "t", "content": ""}
    assert user["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
        {"type": "text", "text": "What are these?"},
    ]


def test_a_text_document_is_its_text_and_a_pdf_a_note_rather_than_a_refusal():
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0"}
    body = _translate(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "document", "source": {"type": "text", "data": "notes"}},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "document", "title": "report.pdf", "source": pdf}],
                    },
                ],
            }
        ]
    )
    tool, user = body["messages"]
    assert user == {"role": "user", "content": "notes"}
    assert tool["content"].startswith("[report.pdf (application/pdf) left out")


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
    ],
)
def test_tool_choice_maps_to_openai(choice, expected):
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"}
    body = _translate(
        messages=[{"role": "user", "content": "Hi"}],
        tools=[{"name": "Bash", "description": "Run", "input_schema": schema}],
        tool_choice=choice,
    )
    assert body["tool_choice"] == expected
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "Bash", "description": "Run", "parameters": schema},
        }
    ]


def test_sampling_fields_stream_and_structured_output_are_carried_over():
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    t = to_openai_chat(
        {
            "model": "m",
            "max_tokens": 32000,
            "messages": [{"role": "user", "content": "Hi"}],
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stream": True,
            "output_config": {
                "effort": "high",
                "format": {"type": "json_schema", "schema": schema},
            },
        }
    )
    body = t.body
    assert (body["max_tokens"], body["stop"], body["temperature"]) == (32000, ["END"], 0.5)
    assert (body["top_p"], body["top_k"], body["stream"]) == (0.9, 40, True)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert t.stream and t.stop_sequences == ["END"]


@pytest.mark.parametrize(
    ("thinking", "on"),
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
    ],
)
def test_thinking_turns_the_template_s_reasoning_on_or_off(thinking, on):
    t = to_openai_chat(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Hi"}]}
        | ({"thinking": thinking} if thinking else {})
    )
    assert t.thinking is on and t.body["chat_template_kwargs"] == {"enable_thinking": on}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}, "model"),
        (
            {"model": "m", "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "text"}]}],
            },
            "messages[0].content[0].text",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "temperature": "hot",
            },
            "temperature",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"input_schema": {}}],
            },
            "tools[0].name",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ],
            },
            "messages[0].content[0].source.type",
        ),
        ([1, 2], "body"),
    ],
)
def test_a_malformed_request_is_a_400_naming_the_field(body, field):
    with pytest.raises(HelexaError) as e:
        to_openai_chat(body)
    assert e.value.status == 400 and e.value.param == field, e.value.message
    assert field in e.value.message


def test_count_tokens_needs_no_max_tokens_and_asks_the_node_for_the_whole_prompt():
    t = to_openai_chat(
        {
            "model": "alias",
            "messages": [{"role": "user", "content": "foo"}],
            "tools": [{"name": "T"}],
        },
        counting=True,
    )
    body = tokenize_body(t, "org/model")
    assert body["model"] == "org/model" and body["add_generation_prompt"] is True
    assert body["messages"] == [{"role": "user", "content": "foo"}]
    assert body["tools"][0]["function"]["parameters"] == {"type": "object", "properties": {}}


# -- whole answers --------------------------------------------------------------------------


def _answer(message: dict, finish: str = "stop", **choice) -> dict:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 60},
        },
    }


def test_a_whole_answer_has_thinking_text_and_tool_use_blocks_in_that_order():
    t = to_openai_chat(
        {"model": "alias", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
        | {"thinking": {"type": "adaptive"}}
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msg = from_openai_chat(
        _answer(
            {"content": "Sure.", "reasoning_content": "hmm", "tool_calls": [call]}, "tool_calls"
        ),
        t,
        "msg_1",
    )
    assert msg["model"] == "alias" and msg["stop_reason"] == "tool_use"
    thinking, text, tool = msg["content"]
    assert (
        thinking["type"] == "thinking" and thinking["thinking"] == "hmm" and thinking["signature"]
    )
    assert text == {"type": "text", "text": "Sure."}
    assert tool == {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    assert msg["usage"] == {
        "input_tokens": 40,
        "output_tokens": 7,
        "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 0,
    }


@pytest.mark.parametrize(
    ("finish", "matched", "reason", "sequence"),
    [
        ("stop", None, "end_turn", None),
        ("length", None, "max_tokens", None),
        ("tool_calls", None, "tool_use", None),
        ("stop", "END", "stop_sequence", "END"),
        ("stop", 128009, "end_turn", None),  # a stop token id, not one of ours
    ],
)
def test_finish_reasons_map_to_stop_reasons(finish, matched, reason, sequence):
    t = to_openai_chat(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
        | {"stop_sequences": ["END"]}
    )
    msg = from_openai_chat(_answer({"content": "a"}, finish, stop_reason=matched), t, "msg_1")
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, sequence)


def test_errors_take_anthropic_types_by_status():
    kinds = {
        s: error_body(s, "m")["error"]["type"]
        for s in (400, 401, 403, 404, 413, 422, 429, 500, 502, 503)
    }
    assert kinds == {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        422: "invalid_request_error",
        429: "rate_limit_error",
        500: "api_error",
        502: "api_error",
        503: "overloaded_error",
    }


def test_a_context_overflow_is_worded_as_anthropic_words_it():
    err = context_length_exceeded(32768, 40001)
    body = error_body(err.status, err.message, err.code)
    assert body["error"]["message"] == "prompt is too long: 40001 tokens > 32768 maximum"


# -- streams --------------------------------------------------------------------------------


def _chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}
    return {"choices": [choice]}


def _run(chunks: list[dict], *, thinking: bool = False, finish: bool = True) -> list:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 100}
    st_ = StreamTranslator(to_openai_chat(body), "msg_1", input_tokens=5)
    events = st_.start()
    for c in chunks:
        events += st_.feed(c)
    if finish:
        events += st_.finish()
    return events


def test_an_upstream_cut_before_the_finish_closes_the_block_and_ends_with_an_error():
    events = _run([_chunk({"content": "Hel"}), _chunk({"content": "lo"})])
    assert [e[0] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert events[-1][1]["error"]["type"] == "api_error"


def test_an_error_inside_the_stream_becomes_an_error_event_and_nothing_after_it():
    error = {
        "error": {
            "message": "queue full",
            "type": "rate_limit_error",
            "code": "rate_limit_exceeded",
        }
    }
    events = _run([_chunk({"content": "a"}), error, _chunk({"content": "b"}, "stop")])
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "rate_limit_error", "message": "queue full"}},
    )
    assert sum(1 for e in events if e[0] == "content_block_delta") == 1


def test_an_empty_answer_is_still_one_empty_text_block():
    message = assert_well_formed(_run([_chunk(finish="stop")]))
    assert message["content"] == [{"type": "text", "text": ""}]
    assert message["usage"]["output_tokens"] == 0


# -- properties -----------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_ids = st.from_regex(r"toolu_[A-Za-z0-9]{6}", fullmatch=True)
_inputs = st.dictionaries(st.sampled_from("abc"), st.integers() | _text, max_size=3)


@st.composite
def _conversations(draw) -> list[dict]:
    """Random Anthropic conversations: user and assistant turns (and stray system turns),
    text, tool_use with unique ids, tool_result answering them, thinking echoed back."""
    turns, pending, n = [], [], 0
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) and draw(st.booleans()):
            turns.append({"role": "system", "content": draw(_text)})
        blocks = [
            {"type": "tool_result", "tool_use_id": i, "content": draw(_text)} for i in pending
        ]
        blocks += [{"type": "text", "text": draw(_text)} for _ in range(draw(st.integers(0, 2)))]
        turns.append({"role": "user", "content": blocks or draw(_text)})
        pending, content = [], []
        if draw(st.booleans()):
            content.append({"type": "thinking", "thinking": draw(_text), "signature": "s"})
        content += [{"type": "text", "text": draw(_text)} for _ in range(draw(st.integers(0, 2)))]
        for _ in range(draw(st.integers(0, 2))):
            n += 1
            pending.append(f"{draw(_ids)}{n}")
            content.append(
                {"type": "tool_use", "id": pending[-1], "name": draw(_text), "input": draw(_inputs)}
            )
        turns.append({"role": "assistant", "content": content or draw(_text)})
    return turns


def _blocks(turn: dict) -> list[dict]:
    c = turn["content"]
    return [{"type": "text", "text": c}] if isinstance(c, str) else c


@settings(max_examples=200, deadline=None)
@given(_conversations())
def test_a_random_conversation_keeps_every_block_tool_id_and_turn_in_order(turns):
    messages = _translate(messages=turns)["messages"]
    systems = [t["content"] for t in turns if t["role"] == "system"]
    if systems:
        assert messages[0] == {"role": "system", "content": "\n\n".join(systems)}
        messages = messages[1:]
    assert all(m["role"] != "system" for m in messages)
    # each Anthropic turn is, in order: tool results, then the user's words; or one assistant
    expected = []
    for turn in (t for t in turns if t["role"] != "system"):
        blocks = _blocks(turn)
        if turn["role"] == "assistant":
            texts = [b["text"] for b in blocks if b["type"] == "text"]
            calls = [(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
            thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            expected.append(("assistant", "\n".join(texts), calls, "\n".join(thoughts)))
            continue
        expected += [
            ("tool", b["tool_use_id"], b["content"]) for b in blocks if b["type"] == "tool_result"
        ]
        words = [b["text"] for b in blocks if b["type"] == "text"]
        if words or not any(b["type"] == "tool_result" for b in blocks):
            expected.append(("user", "\n".join(words)))
    got = []
    for m in messages:
        if m["role"] == "assistant":
            calls = [
                (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m.get("tool_calls", [])
            ]
            got.append(("assistant", m["content"] or "", calls, m.get("reasoning_content", "")))
        elif m["role"] == "tool":
            got.append(("tool", m["tool_call_id"], m["content"]))
        else:
            got.append(("user", m["content"]))
    assert got == expected


@st.composite
def _openai_answers(draw) -> tuple[str, str, list[tuple[str, str, dict]], str]:
    reasoning = draw(st.text(max_size=30))
    content = draw(st.text(max_size=30))
    calls = [(f"call_{i}", draw(_text), draw(_inputs)) for i in range(draw(st.integers(0, 3)))]
    finish = "tool_calls" if calls else draw(st.sampled_from(["stop", "length"]))
    return reasoning, content, calls, finish


def _pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=4)))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if text[a:b]]


@settings(max_examples=200, deadline=None)
@given(_openai_answers(), st.data())
def test_a_streamed_answer_builds_the_same_message_as_the_whole_one(answer, data):
    reasoning, content, calls, finish = answer
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    t = to_openai_chat(body | {"thinking": {"type": "adaptive"}})
    tool_calls = [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, n, a in calls
    ]
    message = {"content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}
    whole = from_openai_chat(_answer(message, finish), t, "msg_1")
    expected = [{"type": "thinking", "thinking": reasoning}] if reasoning else []
    expected += [{"type": "text", "text": content}] if content or not (reasoning or calls) else []
    expected += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]
    assert [{k: v for k, v in b.items() if k != "signature"} for b in whole["content"]] == expected
    # the same answer, cut into random deltas
    chunks = [_chunk({"role": "assistant", "content": ""})]
    chunks += [_chunk({"reasoning_content": p}) for p in _pieces(data.draw, reasoning)]
    chunks += [_chunk({"content": p}) for p in _pieces(data.draw, content)]
    for index, (i, n, a) in enumerate(calls):
        args = _pieces(data.draw, json.dumps(a))
        head = {
            "index": index,
            "id": i,
            "type": "function",
            "function": {"name": n, "arguments": ""},
        }
        chunks.append(_chunk({"tool_calls": [head]}))
        chunks += [
            _chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]}) for p in args
        ]
    last = _answer({}, finish)
    chunks.append({**_chunk(finish=finish), "usage": last["usage"]})
    translator = StreamTranslator(t, "msg_1")
    events = translator.start()
    for c in chunks:
        events += translator.feed(c)
    events += translator.finish()
    wire = b"".join(sse_event(*e) for e in events).decode().splitlines()
    streamed = assert_well_formed(parse_events(wire))
    assert streamed["content"] == whole["content"]
    assert (streamed["stop_reason"], streamed["usage"]) == (whole["stop_reason"], whole["usage"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=6), st.data())
def test_sse_payloads_survive_any_split_of_the_byte_stream(payloads, data):
    wire = (
        b"".join(f"data: {json.dumps(p)}\r\n\r\n".encode() for p in payloads) + b"data: [DONE]\n\n"
    )
    cuts = sorted(data.draw(st.sets(st.integers(0, len(wire)), max_size=8)))
    reader, got = SSEReader(), []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += [e.data for e in reader.feed(wire[a:b])]
    assert got == [json.dumps(p) for p in payloads] + ["[DONE]"]


def _events_whole(wire: bytes) -> list[tuple[str | None, str]]:
    """The events of a whole SSE byte stream, read the plain way (the reference)."""
    out = []
    for block in wire.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]:
        name, data = None, []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" ").decode())
        if data:
            out.append((name, "\n".join(data)))
    return out


_sse_text = st.text(  # what a UTF-8 stream can carry (no lone surrogates), one line
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=8
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.none() | _sse_text, st.lists(_sse_text, min_size=0, max_size=3), st.booleans()
        ),
        max_size=6,
    ),
    st.data(),
)
def test_named_and_many_line_events_survive_any_split_of_the_byte_stream(events, data):
    """Events with `event:` names, several `data:` lines (or none: a comment-only block),
    CRLF or LF line ends, cut anywhere: the same events as the whole stream read at once."""
    parts = []
    for name, lines, crlf in events:
        end = "\r\n" if crlf else "\n"
        block = ([f"event: {name}"] if name is not None else []) + [f"data: {x}" for x in lines]
        parts.append(end.join(block or [": comment"]) + end + end)
    wire = "".join(parts).encode()
    cuts = sorted(data.draw(st.sets(st.integers(0, len(wire)), max_size=8)))
    reader, got = SSEReader(), []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += [(e.name, e.data) for e in reader.feed(wire[a:b])]
    assert got == _events_whole(wire)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        "type",
        "text",
        "role",
        "content",
        "source",
        "id",
        "name",
        "input",
        "tool_use_id",
        "is_error",
        "thinking",
        "media_type",
        "data",
        "url",
        "input_schema",
        "budget_tokens",
    ]
)
_shaped = st.recursive(
    _json,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=20,
)


_FIELDS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "stop_sequences",
    "temperature",
    "top_k",
    "stream",
    "output_config",
    "metadata",
]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _shaped))
def test_any_body_is_translated_or_refused_with_a_400_never_anything_else(body):
    try:
        to_openai_chat(body)
    except HelexaError as e:
        assert e.status == 400, e
        assert e.param.split("[")[0].split(".")[0] in _FIELDS, e.param


_chunk_keys = st.sampled_from(
    [
        "choices",
        "delta",
        "content",
        "reasoning_content",
        "tool_calls",
        "index",
        "id",
        "function",
        "name",
        "arguments",
        "finish_reason",
        "stop_reason",
        "usage",
        "message",
        "error",
        "code",
    ]
)
_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_chunk_keys, inner, max_size=4),
    max_leaves=15,
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_chunk_keys, _junk), st.lists(_junk, max_size=5))
def test_odd_upstream_answers_and_chunks_never_crash_the_translators(answer, chunks):
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    t = to_openai_chat(body | {"thinking": {"type": "adaptive"}})
    sse_event("message", from_openai_chat(answer, t, "msg_1"))
    translator = StreamTranslator(t, "msg_1")
    events = translator.start()
    for c in chunks:
        events += translator.feed(c)
    events += translator.finish()
    assert events[-1][0] in ("message_stop", "error")
    assert all(sse_event(*e) for e in events)
