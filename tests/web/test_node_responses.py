"""The Responses API on a real node, driven by the official openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.web.conftest import REASONING, SCRIPT
from tests.web.test_node_agents import EXPECTED_CALLS, TOOLS

# The chat tests' tools in the Responses shape (flat), plus a built-in tool, which cannot
# run here and is left out, not refused.
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS] + [{"type": "web_search"}]


@pytest.fixture(scope="module")
def agents(agent_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_node.v1, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.v1, api_key="unused", max_retries=0)


def test_text_input_gets_a_whole_response(plain, scripted_id):
    r = plain.responses.create(model=scripted_id, input="Say hello", instructions="Be brief.")
    assert r.status == "completed"
    assert r.output_text == SCRIPT
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_an_incomplete_response(plain, scripted_id):
    r = plain.responses.create(model=scripted_id, input="Say hello", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_a_stream_names_every_event_and_the_sdk_reads_it(plain, scripted_id):
    stream = plain.responses.create(model=scripted_id, input="Say hello", stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 5 and "".join(deltas) == SCRIPT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == SCRIPT


def test_the_stream_helper_assembles_the_final_response(plain, scripted_id):
    with plain.responses.stream(model=scripted_id, input="Say hello") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == SCRIPT


def test_reasoning_comes_as_a_reasoning_item_with_its_token_count(agents, agent_models):
    r = agents.responses.create(
        model=agent_models["think"], input="2+2?", reasoning={"effort": "high"}
    )
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].summary[0].text == f"\n{REASONING}\n"
    assert r.output_text == "The answer is 4."
    assert r.usage.output_tokens_details.reasoning_tokens > 10


def test_streamed_reasoning_arrives_as_summary_text_deltas(agents, agent_models):
    events = list(
        agents.responses.create(
            model=agent_models["think"], input="2+2?", reasoning={"effort": "low"}, stream=True
        )
    )
    summary = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert len(summary) > 10 and "".join(summary) == f"\n{REASONING}\n"
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(text) == "The answer is 4."
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "message"]


def test_function_calls_come_back_as_items_streamed_and_not(agents, agent_models):
    r = agents.responses.create(model=agent_models["calls"], input="go", tools=FUNCTIONS)
    calls = [i for i in r.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS
    assert all(c.call_id.startswith("call_") for c in calls)

    events = list(
        agents.responses.create(
            model=agent_models["calls"], input="go", tools=FUNCTIONS, stream=True
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == EXPECTED_CALLS
    final = events[-1].response
    assert [i.type for i in final.output] == ["message", "function_call", "function_call"]


def test_a_function_call_round_trip_as_input_items_renders_and_answers(agents, agent_models):
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": -3}'},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "And tomorrow?"}],
        },
    ]
    for model in ("think", "coder"):
        r = agents.responses.create(model=agent_models[model], input=items, tools=FUNCTIONS)
        assert r.status == "completed" and r.output_text


def test_previous_response_id_is_refused_clearly(plain, scripted_id):
    with pytest.raises(openai.BadRequestError) as e:
        plain.responses.create(model=scripted_id, input="hi", previous_response_id="resp_1")
    assert e.value.code == "chained_conversation_not_supported"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": [{"type": "telepathy"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, None),
        ({"input": "hi", "max_output_tokens": "lots"}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": 7}, "tool_choice"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(node, scripted_id, body, param):
    r = httpx.post(node.v1 + "/responses", json={"model": scripted_id, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_a_tool_choice_the_model_ignores_fails_the_stream_visibly(agent_node, agent_models):
    body = {  # a vocabulary without call markers: the call cannot be constrained
        "model": agent_models["plain_smol"],
        "input": "go",
        "tools": FUNCTIONS,
        "tool_choice": "required",
        "stream": True,
    }
    with httpx.stream("POST", agent_node.v1 + "/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][6:])
    assert last["type"] == "response.failed"
    assert last["response"]["error"]["code"] == "tool_choice_not_satisfied"
