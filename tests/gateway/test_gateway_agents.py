"""Agents' protocols through a real gateway: tool calls and the Responses API pass through
whole, and their usage (Responses' own shape included) lands in the ledger."""

from __future__ import annotations

import json
import time

import openai
import pytest
from sqlalchemy import select

from helexa.db.models import SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.web.conftest import REASONING
from tests.web.test_node_agents import EXPECTED_CALLS, TOOLS
from tests.web.test_node_responses import FUNCTIONS


@pytest.fixture(scope="module")
def gw(tmp_path_factory, agent_node):
    gw = start_gateway(tmp_path_factory.mktemp("gw-agents"), {"n": agent_node})
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def key(gw):
    return KeyStore(session_factory(make_engine(gw.database_url))).create("acme", cap_tokens=10**6)


@pytest.fixture(scope="module")
def client(gw, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key[1], max_retries=0)


def _ledger_row(gw, key_id: str, model: str) -> SpendRecord:
    """The key's one ledger row for `model`, once the batched ledger has written it."""
    sessions = session_factory(make_engine(gw.database_url))
    deadline = time.monotonic() + 10
    while True:
        with sessions() as s:
            query = select(SpendRecord).where(
                SpendRecord.key_id == key_id, SpendRecord.model == model
            )
            rows = s.scalars(query).all()
        if rows or time.monotonic() > deadline:
            assert len(rows) == 1, f"{len(rows)} ledger rows for {model}"
            return rows[0]
        time.sleep(0.1)


def test_streamed_tool_calls_pass_through_the_gateway(client, agent_models):
    with client.chat.completions.stream(
        model=agent_models["calls"],
        messages=[{"role": "user", "content": "go"}],
        tools=TOOLS,
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_streamed_responses_call_is_metered_from_its_own_usage(gw, key, client, agent_models):
    events = list(
        client.responses.create(
            model=agent_models["think"],
            input="2+2?",
            reasoning={"effort": "high"},
            tools=FUNCTIONS,
            stream=True,
        )
    )
    final = events[-1].response
    assert final.status == "completed"
    assert final.output[0].summary[0].text == f"\n{REASONING}\n"
    row = _ledger_row(gw, key[0].id, agent_models["think"])
    assert row.prompt_tokens == final.usage.input_tokens
    assert row.completion_tokens == final.usage.output_tokens
    assert row.reasoning_tokens == final.usage.output_tokens_details.reasoning_tokens > 10
