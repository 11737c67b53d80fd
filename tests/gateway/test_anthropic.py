"""The Anthropic Messages API through a real gateway and a real node, driven by the official
`anthropic` SDK where it can be: answers, streams, tools, thinking, counting, errors, keys
and budgets."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import anthropic
import httpx
import pytest
from sqlalchemy import select

from helexa.db.models import SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from helexa.protocol.anthropic import to_openai_chat
from helexa.protocol.anthropic_out import StreamTranslator
from helexa.web.gateway_anthropic import anthropic_events
from tests.gateway.anthropic_events import assert_well_formed, parse_events, stream_events
from tests.gateway.gateway_proc import start_gateway
from tests.web.conftest import REASONING, SCRIPT
from tests.web.node_proc import start_node
from tests.web.test_node_lifecycle import _wait_for

ASK = [{"role": "user", "content": "What is 2+2? Then check the weather."}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^.+$"},
                "days": {"type": "integer", "exclusiveMinimum": 0},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "search",
        "input_schema": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"anyOf": [{"type": "integer"}, {"const": "all"}]},
                "exact": {"type": "boolean"},
                "filters": {"type": "object", "propertyNames": {"format": "uri"}},
                "score": {"type": "number"},
            },
        },
    },
]
WEATHER = {"city": "Zürich 🇨🇭", "days": 3}


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dirs):
    models = [model_dirs["scripted"], model_dirs["tiny"]]
    node = start_node(tmp_path_factory.mktemp("anthropic-node"), models)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory, node, agent_node, scripted_id, tiny_id):
    # the agents' scripted models come from the session's agent node (a dozen of them)
    gw = start_gateway(
        tmp_path_factory.mktemp("anthropic-gw"),
        {"n": node, "agents": agent_node},
        models=[{"id": scripted_id, "cost": {"input": 1.0, "output": 2.0}}, {"id": tiny_id}],
        aliases={"helexa/test": scripted_id},
    )
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base_url, api_key="sk-placeholder", max_retries=0)


def _hello(model: str = "helexa/test", **kw) -> dict:
    return {
        "model": model,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Hi"}],
        **kw,
    }


# -- answers --------------------------------------------------------------------------------


def test_messages_create_answers_with_a_text_block_end_turn_and_usage(client):
    msg = client.messages.create(**_hello())
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == "helexa/test"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == SCRIPT
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0
    assert msg.usage.output_tokens > 0


def test_messages_stream_gives_the_text_as_it_comes_and_the_final_message(client):
    with client.messages.stream(**_hello(system="Be brief.")) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == SCRIPT
    assert final.content[0].text == SCRIPT
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(pieces) + 1  # every token, the eos included


def test_the_raw_event_stream_is_well_formed_and_carries_usage(gw):
    events = stream_events(gw.base_url, _hello())
    message = assert_well_formed(events)
    assert message["content"] == [{"type": "text", "text": SCRIPT}]
    start = events[0][1]["message"]["usage"]
    assert start["input_tokens"] > 0  # an estimate first; the node's count at the end
    assert message["usage"]["output_tokens"] > 0


def test_a_stop_sequence_ends_the_answer_and_is_named(client, gw):
    msg = client.messages.create(**_hello(stop_sequences=["never", "42"]))
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "42"
    assert msg.content[0].text == SCRIPT.split("42")[0]
    message = assert_well_formed(stream_events(gw.base_url, _hello(stop_sequences=["42"])))
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "42"


def test_max_tokens_cuts_the_answer_with_stop_reason_max_tokens(client):
    msg = client.messages.create(**_hello(max_tokens=3))
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_count_tokens_is_the_node_s_count_of_the_rendered_prompt(client, node, scripted_id):
    counted = client.messages.count_tokens(
        model="helexa/test", system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    direct = node.post(
        "/tokenize",
        {
            "model": scripted_id,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "add_generation_prompt": True,
        },
    ).json()["count"]
    assert counted.input_tokens == direct > 0


def test_unknown_fields_betas_and_headers_are_never_refused(gw):
    body = _hello(
        metadata={"user_id": json.dumps({"device_id": "0", "session_id": "s"})},
        thinking={"type": "a-kind-from-the-future"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "max", "format": {"type": "json_schema", "schema": {}}},
        service_tier="auto",
        container="c",
        mcp_servers=[],
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
    )
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "a-beta-from-2099-01-01,context-1m-2025-08-07",
        "x-app": "cli",
    }
    r = httpx.post(gw.base_url + "/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    # the empty schema admits any JSON value: the scripted model is held to one
    answer = r.json()
    if answer["stop_reason"] == "end_turn":
        json.loads(answer["content"][0]["text"])  # raises unless it is JSON
    else:
        assert answer["stop_reason"] == "max_tokens"


# -- tools and thinking (the scripted models speak through the Qwen3 vocabulary) -------------


def test_a_tool_round_trip_is_tool_use_then_end_turn(client, agent_models):
    first = client.messages.create(
        model=agent_models["calls"], max_tokens=500, messages=ASK, tools=TOOLS
    )
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use", "tool_use"]
    assert first.content[0].text.strip() == "I will look both up."
    weather, search = first.content[1:]
    assert (weather.name, weather.input) == ("get_weather", WEATHER)
    assert search.name == "search" and search.input["query"] == "best café ☕"
    assert weather.id != search.id
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": weather.id, "content": "-3 °C"},
                {
                    "type": "tool_result",
                    "tool_use_id": search.id,
                    "content": [{"type": "text", "text": "no café open"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Summarise, please."},
            ],
        },
    ]
    final = client.messages.create(
        model=agent_models["plain"], max_tokens=500, messages=history, tools=TOOLS
    )
    assert final.stop_reason == "end_turn"
    assert final.content[0].text == "I would rather not call a tool."


def test_streamed_tool_use_arrives_as_input_json_deltas_the_sdk_assembles(
    client,
    gw,
    agent_models,
):
    with client.messages.stream(
        model=agent_models["calls"], max_tokens=500, messages=ASK, tools=TOOLS
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content][:2] == [
        ("text", None),
        ("tool_use", WEATHER),
    ]
    events = stream_events(gw.base_url, {**_hello(agent_models["calls"]), "tools": TOOLS})
    message = assert_well_formed(events)
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][1]["input"] == WEATHER


def test_tool_choice_any_holds_the_model_to_a_call(client, agent_models):
    with pytest.raises(anthropic.UnprocessableEntityError) as e:  # no call markers: refused
        client.messages.create(
            model=agent_models["plain_smol"],
            max_tokens=100,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "any"},
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    msg = client.messages.create(
        model=agent_models["forced_json"],  # writes the call the grammar holds it to
        max_tokens=500,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert msg.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in msg.content] == [("get_weather", {"city": "Oslo"})]


def test_thinking_comes_back_as_signed_thinking_blocks_when_asked(client, gw, agent_models):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    msg = client.messages.create(
        model=agent_models["think"], max_tokens=500, messages=ASK, thinking=thinking
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking.strip() == REASONING and msg.content[0].signature
    assert msg.content[1].text == "The answer is 4."
    events = stream_events(
        gw.base_url, {**_hello(agent_models["think"]), "thinking": {"type": "adaptive"}}
    )
    streamed = assert_well_formed(events)
    kinds = [e[1]["delta"]["type"] for e in events if e[0] == "content_block_delta"]
    assert kinds.count("thinking_delta") > 5 and kinds.count("signature_delta") == 1
    assert streamed["content"][0]["thinking"] == msg.content[0].thinking
    assert streamed["content"][0]["signature"] == msg.content[0].signature  # stable
    # echoed back verbatim, signature and all, the conversation goes on
    again = client.messages.create(
        model=agent_models["think"],
        max_tokens=500,
        thinking=thinking,
        messages=[
            *ASK,
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {"role": "user", "content": "And 3+3?"},
        ],
    )
    assert again.stop_reason == "end_turn"


def test_thinking_is_not_shown_unless_asked(client, agent_models):
    for thinking in (None, {"type": "disabled"}):
        extra = {"thinking": thinking} if thinking else {}
        msg = client.messages.create(
            model=agent_models["think"], max_tokens=500, messages=ASK, **extra
        )
        assert [b.type for b in msg.content] == ["text"]
        assert msg.content[0].text == "The answer is 4."


# -- errors ---------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_malformed_requests_are_400_invalid_request_errors_naming_the_field(gw):
    url = gw.base_url + "/v1/messages"
    no_max = {"model": "helexa/test", "messages": [{"role": "user", "content": "Hi"}]}
    assert "max_tokens" in _error(httpx.post(url, json=no_max), 400, "invalid_request_error")
    bad = _hello(messages=[{"role": "user", "content": 7}])
    message = _error(httpx.post(url, json=bad), 400, "invalid_request_error")
    assert "messages[0].content" in message
    not_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert "JSON" in _error(not_json, 400, "invalid_request_error")
    tool = _hello(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice.name" in _error(httpx.post(url, json=tool), 400, "invalid_request_error")


def test_an_unknown_model_is_404_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**_hello("no/such-model"))
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no/such-model", messages=ASK)


def test_a_node_refusal_comes_back_in_anthropic_shape(gw, tiny_id):
    url = gw.base_url + "/v1/messages"
    hot = httpx.post(url, json=_hello(temperature=-1.0), timeout=60)
    assert "temperature" in _error(hot, 400, "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iV"}}
    seen = _hello(tiny_id, messages=[{"role": "user", "content": [image]}])
    assert "image" in _error(httpx.post(url, json=seen, timeout=60), 400, "invalid_request_error")


def test_a_prompt_over_the_context_is_worded_as_anthropic_does_for_compaction(gw, tiny_id):
    long = _hello(tiny_id, messages=[{"role": "user", "content": "word " * 400}])
    r = httpx.post(gw.base_url + "/v1/messages", json=long, timeout=60)
    message = _error(r, 400, "invalid_request_error")
    assert message.startswith("prompt is too long: ") and message.endswith(" > 256 maximum")


def test_no_reachable_node_is_503_overloaded_error_with_retry_after(tmp_path):
    from tests.web.node_proc import free_port

    gw = start_gateway(tmp_path, {"gone": f"http://127.0.0.1:{free_port()}"}, wait_up=False)
    try:
        r = httpx.post(gw.base_url + "/v1/messages", json=_hello(), timeout=30)
        _error(r, 503, "overloaded_error")
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        gw.stop()


# -- keys and budgets -----------------------------------------------------------------------


def test_a_closed_gateway_takes_the_key_as_x_api_key_or_bearer(tmp_path, node, scripted_id):
    gw = start_gateway(tmp_path, {"n": node}, gateway={"require_auth": True})
    try:
        _, secret = KeyStore(session_factory(make_engine(gw.database_url))).create("acme")
        sdk = anthropic.Anthropic(base_url=gw.base_url, api_key=secret, max_retries=0)
        assert sdk.messages.create(**_hello(scripted_id)).content[0].text == SCRIPT
        assert sdk.messages.count_tokens(model=scripted_id, messages=ASK).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=gw.base_url, auth_token=secret, max_retries=0)
        assert bearer.messages.create(**_hello(scripted_id)).stop_reason == "end_turn"
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(
                base_url=gw.base_url, api_key="sk-wrong", max_retries=0
            ).messages.create(**_hello(scripted_id))
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(gw.base_url + "/v1/messages", json=_hello(scripted_id))
        _error(r, 401, "authentication_error")
    finally:
        gw.stop()


def _ledger_rows(gw, key_id: str, expect: int) -> list[SpendRecord]:
    sessions = session_factory(make_engine(gw.database_url))
    deadline = time.monotonic() + 10
    while True:
        with sessions() as s:
            rows = s.scalars(select(SpendRecord).where(SpendRecord.key_id == key_id)).all()
        if len(rows) >= expect or time.monotonic() > deadline:
            return list(rows)
        time.sleep(0.1)


def test_a_budgeted_key_is_metered_and_capped_like_on_the_openai_routes(gw, scripted_id):
    store = KeyStore(session_factory(make_engine(gw.database_url)))
    info, secret = store.create("acme", cap_tokens=100_000)
    sdk = anthropic.Anthropic(base_url=gw.base_url, api_key=secret, max_retries=0)
    whole = sdk.messages.create(**_hello())
    with sdk.messages.stream(**_hello()) as stream:
        streamed = stream.get_final_message()
    rows = _ledger_rows(gw, info.id, 2)
    assert len(rows) == 2 and {r.status for r in rows} == {200}
    assert {r.model for r in rows} == {scripted_id}
    for row, msg in zip(rows, (whole, streamed), strict=True):
        u = msg.usage
        cached, written = u.cache_read_input_tokens, u.cache_creation_input_tokens
        assert row.prompt_tokens == u.input_tokens + cached + written
        assert (row.cached_tokens, row.cache_write_tokens) == (cached, written)
        assert row.completion_tokens == u.output_tokens
        assert row.cost_usd > 0  # the catalogue's prices applied
    metrics = httpx.get(gw.metrics_url + "/metrics", timeout=10).text
    assert f'helexa_spend_tokens_total{{account="acme",key="{info.id}"}}' in metrics
    assert 'helexa_requests_total{code="200",route="/v1/messages"}' in metrics
    assert gw.get("/health").json()["budget_reserved_tokens"] == 0

    _, poor = store.create("thrift", cap_tokens=50)
    broke = anthropic.Anthropic(base_url=gw.base_url, api_key=poor, max_retries=0)
    statuses = []
    for _ in range(6):
        try:
            broke.messages.create(**_hello())
            statuses.append(200)
        except anthropic.RateLimitError as e:
            assert e.body["error"]["type"] == "rate_limit_error"
            statuses.append(429)
    assert statuses[-1] == 429


# -- streams that end badly -----------------------------------------------------------------


@pytest.fixture(scope="module")
def long_fleet(tmp_path_factory, long_id):
    tmp = tmp_path_factory.mktemp("anthropic-long")
    node = start_node(tmp / "node", [long_id])
    gw = start_gateway(tmp, {"n": node})
    yield gw, node
    gw.stop()
    node.stop()


def _in_flight(node, model: str) -> int:
    return next(m for m in node.get("/health").json()["models"] if m["id"] == model)["in_flight"]


def test_leaving_a_stream_early_stops_the_node_generating(long_fleet, long_id):
    gw, node = long_fleet
    body = {**_hello(long_id, max_tokens=4000), "stream": True}
    with httpx.stream("POST", gw.base_url + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "text_delta" in line:
                assert _in_flight(node, long_id) == 1  # not buffered: the node is mid-answer
                break
    _wait_for(lambda: _in_flight(node, long_id) == 0, timeout=10)


def test_a_node_dying_mid_stream_still_closes_the_events_with_an_error(long_fleet, long_id):
    gw, node = long_fleet
    body = {**_hello(long_id, max_tokens=4000), "stream": True}
    with httpx.stream("POST", gw.base_url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines, stream = [], r.iter_lines()
        for line in stream:
            lines.append(line)
            if line.startswith("data:") and "text_delta" in line and len(lines) > 20:
                node.stop(signal.SIGKILL)
                break
        lines += list(stream)  # the rest, until the gateway closes the stream
    events = parse_events(lines)
    assert events[0][0] == "message_start"
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    assert events[-2][0] == "content_block_stop"  # the open block was closed first
    assert "message_stop" not in [name for name, _ in events]


def test_a_silent_upstream_gets_pings_until_it_speaks():
    async def collect() -> list[bytes]:
        pinged = asyncio.Event()  # the node stays silent until the client has had 3 pings

        async def silent_node():
            await asyncio.wait_for(pinged.wait(), 60)  # a hang guard only
            yield b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
            yield b"data: [DONE]\n\n"

        t = to_openai_chat(_hello())
        events = anthropic_events(silent_node(), StreamTranslator(t, "msg_1"), ping_interval_s=0.1)
        out: list[bytes] = []
        async for e in events:
            out.append(e)
            if sum(b"event: ping" in o for o in out) == 3:
                pinged.set()
        return out

    lines = b"".join(asyncio.run(collect())).decode().splitlines()
    events = parse_events(lines)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[1:4] == ["ping", "ping", "ping"]
    assert assert_well_formed(events)["content"] == [{"type": "text", "text": "hi"}]
