"""Structured output through a real gateway in front of a real node, driven by the official
SDKs: the openai SDK's `chat.completions.parse` with a pydantic model, Responses'
`text.format`, the anthropic SDK's `output_config` JSON schema (and `messages.parse`), and
tools held to their schemas on both APIs. The node serves random-weight models sampled at
temperature 1, whose free answers are gibberish: every answer that ends is valid JSON for
its schema, and one cut by max_tokens says so (finish_reason "length", stop_reason
"max_tokens")."""

from __future__ import annotations

import enum
import json
import signal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.gateway_proc import start_gateway
from tests.structured_models import (
    SCHEMAS,
    TOOL_SCHEMAS,
    qwen3_random_model,
    validate,
)
from tests.web.node_proc import start_node
from tests.web.test_node_structured import parse_a_pet

SEEDS = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dirs) -> dict[str, str]:
    root = tmp_path_factory.mktemp("structured-models")
    return {
        "tiny": str(model_dirs["tiny"]),  # SmolLM2's vocabulary
        "qwen3": str(qwen3_random_model(root, "qwen3")),  # Hermes tool calls
    }


@pytest.fixture(scope="module")
def gw(tmp_path_factory, models):
    node = start_node(tmp_path_factory.mktemp("structured-node"), list(models.values()))
    gw = start_gateway(tmp_path_factory.mktemp("structured-gw"), {"n": node})
    yield gw
    gw.stop()
    node.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0)


def test_the_openai_sdk_parse_works_through_the_gateway(gw, models):
    pets = parse_a_pet(gw.v1, models["tiny"])
    assert len(pets) == 1


def test_responses_text_format_works_through_the_gateway(gw, models):
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    schema = SCHEMAS["enum"]
    fmt = {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}
    completed = 0
    for seed in range(SEEDS):
        r = client.responses.create(
            model=models["tiny"],
            input="Pick a colour, a size and a level.",
            text={"format": fmt},
            temperature=1,
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        if r.status == "completed":
            validate(r.output_text, schema)
            completed += 1
        else:
            assert r.incomplete_details.reason == "max_output_tokens", r
    assert completed >= 1


def test_an_anthropic_output_config_schema_holds_the_answer(claude, models):
    schema = SCHEMAS["nested"]
    ended = 0
    for seed in range(SEEDS):
        msg = claude.messages.create(
            model=models["tiny"],
            max_tokens=200,
            messages=[{"role": "user", "content": "Describe a user as JSON."}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body={"seed": seed, "temperature": 1},
        )
        assert [b.type for b in msg.content] == ["text"]
        if msg.stop_reason == "end_turn":
            validate(msg.content[0].text, schema)
            ended += 1
        else:
            assert msg.stop_reason == "max_tokens", msg
    assert ended >= 1


def test_a_streamed_anthropic_answer_is_held_to_its_schema_too(claude, models):
    schema = SCHEMAS["enum"]
    with claude.messages.stream(
        model=models["tiny"],
        max_tokens=200,
        messages=[{"role": "user", "content": "Pick."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"seed": 1, "temperature": 1},
    ) as stream:
        msg = stream.get_final_message()
    if msg.stop_reason == "end_turn":
        validate(msg.content[0].text, schema)
    else:
        assert msg.stop_reason == "max_tokens", msg


class Size(enum.StrEnum):
    small = "small"
    large = "large"


class Order(BaseModel):
    size: Size
    gift: bool
    quantity: int


def test_the_anthropic_sdk_parse_returns_a_pydantic_instance(gw, models):
    sent: list[dict] = []
    http = anthropic.DefaultHttpxClient(  # the SDK's own httpx
        event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]}, timeout=120
    )
    client = anthropic.Anthropic(
        base_url=gw.base_url, api_key="unused", max_retries=0, http_client=http
    )
    parsed = []
    for seed in range(SEEDS):
        msg = client.messages.parse(
            model=models["tiny"],
            max_tokens=200,
            messages=[{"role": "user", "content": "An order, please."}],
            output_format=Order,
            extra_body={"seed": seed, "temperature": 1},
        )
        if msg.stop_reason == "end_turn":
            parsed.append(msg.parsed_output)
            break
    assert sent[0]["output_config"]["format"]["type"] == "json_schema"
    assert parsed and isinstance(parsed[0], Order), parsed


def test_an_anthropic_schema_the_engine_cannot_enforce_is_a_400(claude, models):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=models["tiny"],
            max_tokens=20,
            messages=[{"role": "user", "content": "n?"}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "'multipleOf'" in e.value.body["error"]["message"]


def test_an_openai_schema_the_engine_cannot_enforce_is_a_400_through_the_gateway(gw, models):
    schema = {"type": "object", "properties": {"n": {"not": {"type": "string"}}}}
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={
            "model": models["tiny"],
            "messages": [{"role": "user", "content": "n?"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "'not'" in r.json()["error"]["message"]


ANTHROPIC_TOOLS = [
    {"name": name, "input_schema": schema, "strict": True} for name, schema in TOOL_SCHEMAS.items()
]


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "named"]
)
def test_anthropic_tool_use_input_is_held_to_the_tools_schema(claude, models, choice):
    calls = 0
    for seed in range(SEEDS):
        msg = claude.messages.create(
            model=models["qwen3"],
            max_tokens=300,
            messages=[{"role": "user", "content": "Weather and time, please."}],
            tools=ANTHROPIC_TOOLS,
            tool_choice={**choice, "disable_parallel_tool_use": True},
            extra_body={"seed": seed, "temperature": 1},
        )
        if msg.stop_reason != "tool_use":
            assert msg.stop_reason == "max_tokens", msg
            continue
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert len(uses) == 1, msg.content
        if choice["type"] == "tool":
            assert uses[0].name == "get_time"
        validate(json.dumps(uses[0].input), TOOL_SCHEMAS[uses[0].name])
        calls += 1
    assert calls >= SEEDS // 2, calls
