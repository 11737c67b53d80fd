"""Agents' protocols on a real node: reasoning apart from content, tool calls parsed into
OpenAI `tool_calls`, with the real Qwen3 tokenizer and templates and scripted answers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.web.conftest import REASONING

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "exclusiveMinimum": 0},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
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
                    "score": {"type": "number"},
                },
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is 2+2? Then check the weather."}]
EXPECTED_CALLS = [
    ("get_weather", {"city": "Zürich 🇨🇭", "days": 3}),
    (
        "search",
        {"query": "best café ☕", "limit": 5, "exact": True, "filters": {"open": True}}
        | {"score": "very high"},  # mistyped for `number`: kept as the string
    ),
]


@pytest.fixture(scope="module")
def client(agent_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_node.v1, api_key="unused", max_retries=0)


def _stream_chunks(agent_node, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream(
        "POST",
        agent_node.v1 + "/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- reasoning ----------------------------------------------------------------------------


def test_reasoning_goes_to_reasoning_content_never_into_content(client, agent_models):
    r = client.chat.completions.create(
        model=agent_models["think"], messages=ASK, reasoning_effort="high"
    )
    message = r.choices[0].message
    assert message.content == "The answer is 4."
    assert message.reasoning_content == f"\n{REASONING}\n"
    details = r.usage.completion_tokens_details
    assert 10 < details.reasoning_tokens < r.usage.completion_tokens


def test_special_marker_tokens_still_split_reasoning_from_content(client, agent_models):
    r = client.chat.completions.create(
        model=agent_models["special"], messages=ASK, reasoning_effort="high"
    )
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (f"\n{REASONING}\n", "The answer is 4.")


def test_streamed_reasoning_spreads_over_many_chunks_and_never_leaks(agent_node, agent_models):
    chunks = _stream_chunks(
        agent_node, {"model": agent_models["think"], "messages": ASK, "reasoning_effort": "low"}
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    content = "".join(d.get("content") or "" for d in deltas)
    assert len(reasoning) > 10
    assert "".join(reasoning) == f"\n{REASONING}\n"
    assert content == "The answer is 4."
    assert "think>" not in content
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 10


def test_x_include_thinking_puts_reasoning_inline_with_its_markers(agent_node, agent_models):
    r = httpx.post(
        agent_node.v1 + "/chat/completions",
        json={"model": agent_models["think"], "messages": ASK},
        headers={"x-include-thinking": "true"},
        timeout=60,
    )
    message = r.json()["choices"][0]["message"]
    assert message["content"] == f"<think>\n{REASONING}\n</think>The answer is 4."
    assert "reasoning_content" not in message


def test_a_template_that_opens_think_starts_the_answer_in_reasoning(client, agent_models):
    r = client.chat.completions.create(
        model=agent_models["opens"], messages=ASK, reasoning_effort="medium"
    )
    message = r.choices[0].message
    assert message.reasoning_content == f"{REASONING}\n"
    assert message.content == "The answer is 4."


def _count(agent_node, model: str, **extra) -> int:
    r = agent_node.post("/tokenize", {"model": model, "messages": ASK, **extra})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_thinking_is_off_unless_the_caller_asks_to_see_it(agent_node, agent_models):
    model = agent_models["think"]
    off = _count(agent_node, model, chat_template_kwargs={"enable_thinking": False})
    on = _count(agent_node, model, chat_template_kwargs={"enable_thinking": True})
    assert off > on  # Qwen3 closes an empty <think></think> when thinking is off
    assert _count(agent_node, model) == off
    assert _count(agent_node, model, reasoning_effort="none") == off
    assert _count(agent_node, model, reasoning_effort="high") == on
    # an explicit enable_thinking wins over reasoning_effort
    kwargs = {"enable_thinking": False}
    assert _count(agent_node, model, reasoning_effort="high", chat_template_kwargs=kwargs) == off


# -- tool calls ---------------------------------------------------------------------------


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_tool_calls_come_back_parsed_in_a_whole_response(client, agent_models):
    r = client.chat.completions.create(model=agent_models["calls"], messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look both up.\n"
    assert _calls(choice.message.tool_calls) == EXPECTED_CALLS
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_streamed_tool_calls_are_assembled_by_the_openai_sdk(client, agent_models):
    with client.chat.completions.stream(
        model=agent_models["calls"], messages=ASK, tools=TOOLS
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _calls(choice.message.tool_calls) == EXPECTED_CALLS
    assert choice.message.content == "I will look both up.\n"


def test_streamed_tool_call_deltas_carry_index_id_type_and_function(agent_node, agent_models):
    chunks = _stream_chunks(
        agent_node, {"model": agent_models["calls"], "messages": ASK, "tools": TOOLS}
    )
    deltas = [
        d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert [d["index"] for d in deltas] == [0, 1]
    assert all(d["type"] == "function" and d["id"].startswith("call_") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "tool_call" not in text and "function=" not in text


def test_a_json_slip_is_repaired(client, agent_models):
    r = client.chat.completions.create(model=agent_models["slip"], messages=ASK, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    assert _calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]


def test_a_garbage_body_falls_back_to_text(client, agent_models):
    r = client.chat.completions.create(model=agent_models["garbage"], messages=ASK, tools=TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.tool_calls is None
    assert message.content == "<tool_call>\nget_weather(city=Oslo)\n</tool_call>"


def test_without_tools_a_call_is_just_text(client, agent_models):
    r = client.chat.completions.create(model=agent_models["slip"], messages=ASK)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")


def test_tool_choice_required_without_a_call_is_an_error(client, agent_node, agent_models):
    """A vocabulary without call markers: the call cannot be constrained, so an answer
    without one is refused after the fact."""
    model = agent_models["plain_smol"]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="required"
        )
    assert e.value.code == "tool_choice_not_satisfied"
    assert "rather not" in e.value.message
    chunks = _stream_chunks(
        agent_node, {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    )
    assert chunks[-1]["error"]["code"] == "tool_choice_not_satisfied"
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    assert streamed == ""  # nothing of the refused answer was sent as if it were fine


def test_a_demanded_call_is_written_even_by_a_model_that_would_not(client, agent_models):
    """With call markers the demanded call is constrained: the grammar allows nothing but
    the call, so even a model scripted to refuse writes it (its name and a body that
    parses), or runs out of tokens trying."""
    for choice in ("required", {"type": "function", "function": {"name": "search"}}):
        r = client.chat.completions.create(
            model=agent_models["plain"], messages=ASK, tools=TOOLS, tool_choice=choice,
            max_tokens=64,
        )  # fmt: skip
        c = r.choices[0]
        assert "rather not" not in (c.message.content or "")
        if c.finish_reason == "tool_calls":
            names = [call.function.name for call in c.message.tool_calls]
            assert names and (choice == "required" or set(names) == {"search"})
            for call in c.message.tool_calls:
                json.loads(call.function.arguments)
        else:
            assert c.finish_reason == "length"


@pytest.mark.parametrize(
    ("model", "tool_choice", "extra"),
    [
        ("forced_json", "required", {}),
        ("forced_json", {"type": "function", "function": {"name": "get_weather"}}, {}),
        ("forced_xml", {"type": "function", "function": {"name": "get_weather"}}, {}),
        ("forced_xml", "required", {}),
        ("think_call", "required", {"reasoning_effort": "high"}),
    ],
)
def test_a_demanded_call_in_the_models_own_format_passes_the_grammar_unchanged(
    client, agent_node, agent_models, model, tool_choice, extra
):
    body = {"model": agent_models[model], "messages": ASK, "tools": TOOLS, **extra}
    r = client.chat.completions.create(**body, tool_choice=tool_choice)
    assert r.choices[0].finish_reason == "tool_calls"
    assert _calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    assert not r.choices[0].message.content
    if model == "think_call":  # reasoning before the call stays free
        assert REASONING in r.choices[0].message.model_extra["reasoning_content"]
    # the call is the grammar's doing, not a prompt that begins it
    with_call = agent_node.post("/tokenize", {**body, "tool_choice": tool_choice}).json()
    assert with_call["tokens"] == agent_node.post("/tokenize", body).json()["tokens"]


def test_parallel_tool_calls_false_ends_the_answer_after_the_first_call(client, agent_models):
    r = client.chat.completions.create(
        model=agent_models["calls"], messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert _calls(r.choices[0].message.tool_calls) == EXPECTED_CALLS[:1]


# -- conversations ------------------------------------------------------------------------

ROUND_TRIP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize("model", ["think", "opens", "coder"])
def test_a_tool_round_trip_conversation_renders_and_answers(agent_node, agent_models, model):
    body = {"model": agent_models[model], "messages": ROUND_TRIP, "tools": TOOLS}
    rendered = agent_node.post("/tokenize", body)
    assert rendered.status_code == 200, rendered.text
    r = agent_node.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_a_template_error_on_a_request_with_tools_is_a_422_naming_it(agent_node, agent_models):
    messages = [*ASK, {"role": "system", "content": "late system turn"}]
    body = {"model": agent_models["opens"], "messages": messages, "tools": TOOLS}
    r = agent_node.post("/v1/chat/completions", body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "template_render_failed"
    assert "System message must be at the beginning" in error["message"]
