"""`helexa acp`'s three wire APIs against a real gateway in front of a real node serving
scripted models (Qwen3's vocabulary and template): reasoning arrives as thoughts and the
answer as text whatever the wire, the node's parsed tool calls (Hermes JSON and Qwen XML)
arrive as calls with their arguments, and every endpoint lists its models."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from helexa.acp.config import Endpoint
from helexa.acp.tools import ToolSpec
from helexa.acp.wire import Message, Wire, WireError
from tests.gateway.gateway_proc import start_gateway
from tests.model_fixtures import AGENT_SCRIPTS, QWEN3, need_shared
from tests.web.node_proc import scripted_model, start_node

WIRES = ("openai-chat", "openai-responses", "anthropic-messages")
TOOLS = [
    ToolSpec(
        "get_weather",
        "The weather in a city.",
        {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        "read",
    ),
    ToolSpec(
        "search",
        "Search.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object"},
                "score": {"type": "string"},
            },
        },
        "search",
    ),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    need_shared()
    root = tmp_path_factory.mktemp("acp-models")
    models = {
        name: str(scripted_model(root, AGENT_SCRIPTS[name], name, tokenizer_from=QWEN3))
        for name in ("think", "calls")
    }
    node = start_node(tmp_path_factory.mktemp("acp-node"), list(models.values()))
    gateway = start_gateway(tmp_path_factory.mktemp("acp-gw"), {"n": node})
    yield gateway, models
    gateway.stop()
    node.stop(signal.SIGTERM)


def _collect(wire: Wire, model: str) -> dict:
    async def run() -> dict:
        out: dict = {"text": "", "thought": "", "calls": {}, "stop": None, "usage": None}
        messages = [Message("system", "Be brief."), Message("user", "What is 2 + 2?")]
        try:
            async for e in wire.stream(model, messages, TOOLS, max_tokens=2048):
                if e.kind in ("text", "thought"):
                    out[e.kind] += e.text
                elif e.kind == "call":
                    out["calls"][e.index] = {"id": e.call_id, "name": e.name, "args": ""}
                elif e.kind == "args":
                    out["calls"][e.index]["args"] += e.text
                elif e.kind == "stop":
                    out["stop"] = e.reason
                elif e.kind == "usage":
                    out["usage"] = (e.prompt, e.completion)
        finally:
            await wire.aclose()
        return out

    return asyncio.run(run())


def _wire(gateway, api: str) -> Wire:
    return Wire(Endpoint("gw", gateway.v1, api))


@pytest.mark.parametrize("api", WIRES)
def test_reasoning_is_a_thought_and_the_answer_text_on_every_wire(served, api):
    gateway, models = served
    got = _collect(_wire(gateway, api), models["think"])
    assert "Let me count" in got["thought"]
    assert got["text"].strip() == "The answer is 4."
    assert got["stop"] == "stop"
    assert got["usage"] is not None and got["usage"][1] > 0


@pytest.mark.parametrize("api", WIRES)
def test_the_nodes_tool_calls_arrive_whole_on_every_wire(served, api):
    gateway, models = served
    got = _collect(_wire(gateway, api), models["calls"])
    calls = [got["calls"][i] for i in sorted(got["calls"])]
    assert [c["name"] for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0]["args"]) == {"city": "Zürich 🇨🇭", "days": 3}
    assert json.loads(calls[1]["args"])["query"] == "best café ☕"
    assert all(c["id"] for c in calls) and len({c["id"] for c in calls}) == 2
    assert got["stop"] == "tool_calls"


@pytest.mark.parametrize("api", WIRES)
def test_every_wire_lists_the_endpoints_models(served, api):
    gateway, models = served
    wire = _wire(gateway, api)

    async def run() -> list[str]:
        try:
            return await wire.models()
        finally:
            await wire.aclose()

    assert set(models.values()) <= set(asyncio.run(run()))


def test_a_refusal_names_its_status_and_the_endpoints_reason(served):
    gateway, _ = served
    with pytest.raises(WireError, match="HTTP 404"):
        _collect(_wire(gateway, "openai-chat"), "no-such-model")
