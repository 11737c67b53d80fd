"""Prompt-cache pricing through a real gateway and a real node: a second turn reads the
first's prompt from the node's prefix cache, and the ledger books each request's cached and
cache-written tokens at the catalogue's prices; Anthropic answers and `/v1/models` say
the same."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import select

from helexa.db.models import SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.web.conftest import SCRIPT
from tests.web.node_proc import start_node

# USD per 1M tokens, each price apart so a token booked at the wrong one shows
PRICES = {"input": 3.0, "output": 15.0, "cache_read": 0.3, "cache_write": 3.75}
SYSTEM = "You are a careful assistant. " * 12  # several KV blocks of 16 tokens
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": SCRIPT},
    {"role": "user", "content": "And now?"},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs, scripted_id, tiny_id):
    tmp = tmp_path_factory.mktemp("cache-pricing")
    node = start_node(tmp / "node", [model_dirs["scripted"], model_dirs["tiny"]])
    models = [{"id": scripted_id, "cost": PRICES}, {"id": tiny_id, "cost": {"input": 2.0}}]
    gw = start_gateway(tmp, {"n": node}, models=models)
    yield gw, node
    gw.stop()
    node.stop()


def _rows(gw, key_id: str, expect: int) -> list[SpendRecord]:
    sessions = session_factory(make_engine(gw.database_url))
    deadline = time.monotonic() + 10
    while True:  # settlement is off the request's path: the row lands just after
        with sessions() as s:
            q = select(SpendRecord).where(SpendRecord.key_id == key_id).order_by(SpendRecord.id)
            rows = list(s.scalars(q).all())
        if len(rows) >= expect or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def _details(usage: dict) -> tuple[int, int]:
    d = usage["prompt_tokens_details"]
    return d["cached_tokens"], d["cache_write_tokens"]


def _cost(prompt: int, completion: int, cached: int, written: int) -> float:
    fresh = prompt - cached - written
    return (
        fresh * PRICES["input"]
        + cached * PRICES["cache_read"]
        + written * PRICES["cache_write"]
        + completion * PRICES["output"]
    ) / 1e6


def test_a_second_turn_reads_the_first_from_the_cache_and_each_token_is_billed_at_its_price(
    fleet, scripted_id
):
    gw, _ = fleet
    info, secret = KeyStore(session_factory(make_engine(gw.database_url))).create("acme")
    headers = {"Authorization": f"Bearer {secret}"}
    usages = []
    for messages in (TURN_1, TURN_2):
        body = {"model": scripted_id, "messages": messages, "max_tokens": 16}
        r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    (cached_1, written_1), (cached_2, written_2) = map(_details, usages)
    # the first turn stored its prompt's full blocks; the second read them back (and those
    # of the first's answer, which it repeats)
    assert cached_1 == 0 and written_1 == usages[0]["prompt_tokens"] // 16 * 16 > 0
    assert cached_2 >= written_1
    assert written_2 == usages[1]["prompt_tokens"] // 16 * 16 - cached_2

    rows = _rows(gw, info.id, 2)
    assert len(rows) == 2
    for row, u in zip(rows, usages, strict=True):
        cached, written = _details(u)
        assert (row.prompt_tokens, row.completion_tokens) == (
            u["prompt_tokens"],
            u["completion_tokens"],
        )
        assert (row.cached_tokens, row.cache_write_tokens) == (cached, written)
        assert row.cost_usd == pytest.approx(
            _cost(u["prompt_tokens"], u["completion_tokens"], cached, written), rel=1e-12
        )
    # a cache hit is worth it: the second turn's prompt is longer, yet its prompt cost less
    # than the same tokens at the input price
    prompt_2 = usages[1]["prompt_tokens"]
    assert rows[1].cost_usd < _cost(prompt_2, usages[1]["completion_tokens"], 0, 0)


def test_an_anthropic_answer_reports_the_cache_the_node_read_and_wrote(fleet, scripted_id):
    gw, _ = fleet
    info, secret = KeyStore(session_factory(make_engine(gw.database_url))).create("anthro")
    _, *messages = TURN_2  # under a system prompt of its own: nothing of it cached yet
    system = "You answer in few words. " * 12
    body = {"model": scripted_id, "max_tokens": 16, "system": system}
    headers = {"x-api-key": secret, "anthropic-version": "2023-06-01"}
    answers = []
    for _ in range(2):  # the second reads all the first stored
        r = httpx.post(
            gw.base_url + "/v1/messages", json=body | {"messages": messages}, headers=headers
        )
        assert r.status_code == 200, r.text
        answers.append(r.json()["usage"])
    rows = _rows(gw, info.id, 2)
    for row, u in zip(rows, answers, strict=True):
        read, created = u["cache_read_input_tokens"], u["cache_creation_input_tokens"]
        assert row.prompt_tokens == u["input_tokens"] + read + created
        assert (row.cached_tokens, row.cache_write_tokens) == (read, created)
    assert answers[1]["cache_read_input_tokens"] >= answers[0]["cache_creation_input_tokens"] > 0
    assert answers[1]["cache_creation_input_tokens"] == 0


def test_the_model_list_shows_the_four_prices_the_cache_ones_defaulting_to_input(
    fleet, scripted_id, tiny_id
):
    gw, _ = fleet
    models = gw.models()
    assert models[scripted_id]["cost"] == PRICES
    assert models[tiny_id]["cost"] == {
        "input": 2.0,
        "output": 0.0,
        "cache_read": 2.0,
        "cache_write": 2.0,
    }
