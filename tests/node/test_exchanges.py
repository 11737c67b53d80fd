"""The book of the gateway's named requests (helexa/node/exchanges.py), without HTTP."""

from __future__ import annotations

import asyncio
import time

import pytest

from helexa.errors import HelexaError
from helexa.node.exchanges import NOTHING_RAN, Exchanges, Usage, parse_wait_s

SPENT = Usage(
    prompt_tokens=30,
    completion_tokens=12,
    cached_tokens=16,
    cache_write_tokens=8,
    reasoning_tokens=4,
)


def _status(coro) -> int:
    with pytest.raises(HelexaError) as e:
        asyncio.run(coro)
    return e.value.status


def test_an_ended_exchange_answers_its_usage_at_once():
    async def scenario() -> dict:
        book = Exchanges()
        book.begin("ex-1").end(SPENT)
        return await book.final_usage("ex-1")

    assert asyncio.run(scenario()) == {
        "exchange": "ex-1",
        "usage": {
            "prompt_tokens": 30,
            "completion_tokens": 12,
            "total_tokens": 42,
            "cached_tokens": 16,
            "cache_write_tokens": 8,
            "reasoning_tokens": 4,
        },
    }


def test_the_first_end_says_what_it_cost_and_later_ones_change_nothing():
    book = Exchanges()
    exchange = book.begin("ex-1")
    exchange.end(SPENT)
    exchange.end(NOTHING_RAN)
    assert exchange.usage == SPENT


def test_a_waiting_ask_wakes_when_the_exchange_ends_not_when_the_wait_is_over():
    async def scenario() -> tuple[dict, float]:
        book = Exchanges()
        exchange = book.begin("ex-1")
        asyncio.get_running_loop().call_later(0.05, exchange.end, SPENT)
        t0 = time.monotonic()
        answer = await book.final_usage("ex-1", wait_s=10)
        return answer, time.monotonic() - t0

    answer, waited = asyncio.run(scenario())
    assert answer["usage"]["completion_tokens"] == 12
    assert waited < 2


def test_an_exchange_settling_later_runs_until_its_count_is_in_and_no_one_else_ends_it():
    """A cut request's run ends before the engine's final count on it arrives: the handler's
    NOTHING_RAN after it changes nothing, and a waiting ask wakes with the count."""

    async def scenario() -> tuple[int, dict, float]:
        book = Exchanges()
        exchange = book.begin("ex-1")
        settle = exchange.settle_later()
        exchange.end(NOTHING_RAN)
        with pytest.raises(HelexaError) as running:
            await book.final_usage("ex-1")
        asyncio.get_running_loop().call_later(0.05, settle, SPENT)
        t0 = time.monotonic()
        answer = await book.final_usage("ex-1", wait_s=10)
        waited = time.monotonic() - t0
        settle(NOTHING_RAN)  # once
        exchange.end(NOTHING_RAN)
        return running.value.status, answer, waited

    status, answer, waited = asyncio.run(scenario())
    assert status == 409
    assert answer["usage"]["completion_tokens"] == 12
    assert waited < 2


def test_settling_later_an_exchange_that_has_ended_changes_nothing():
    exchange = Exchanges().begin("ex-1")
    exchange.end(SPENT)
    exchange.settle_later()(NOTHING_RAN)
    assert exchange.usage == SPENT


def test_a_running_exchange_is_409_after_its_wait_and_an_unknown_one_404():
    async def running(wait_s: float) -> dict:
        book = Exchanges()
        book.begin("ex-1")
        return await book.final_usage("ex-1", wait_s)

    assert _status(running(0)) == 409
    assert _status(running(0.05)) == 409
    assert _status(Exchanges().final_usage("ex-1")) == 404
    assert _status(Exchanges().final_usage("no/such")) == 400


def test_the_book_forgets_its_oldest_exchanges_past_its_capacity():
    book = Exchanges(capacity=3)
    for i in range(5):
        book.begin(f"ex-{i}")
    assert len(book) == 3
    assert book.get("ex-0") is None and book.get("ex-1") is None
    assert book.get("ex-4") is not None


def test_an_id_used_again_names_the_newer_request():
    book = Exchanges(capacity=2)
    first = book.begin("ex-1")
    book.begin("ex-2")
    again = book.begin("ex-1")
    book.begin("ex-3")  # evicts ex-2, the oldest now
    assert book.get("ex-1") is again is not first
    assert book.get("ex-2") is None


@pytest.mark.parametrize("bad", ["", "x" * 65, "a.b", "a b", "é"])
def test_an_id_that_cannot_be_one_is_a_400_naming_the_header(bad):
    with pytest.raises(HelexaError) as e:
        Exchanges().begin(bad)
    assert e.value.status == 400
    assert e.value.param == "x-helexa-exchange"


@pytest.mark.parametrize(
    ("raw", "seconds"), [(None, 0.0), ("", 0.0), ("0", 0.0), ("2.5", 2.5), ("600", 10.0)]
)
def test_wait_s_is_seconds_clamped_to_ten(raw, seconds):
    assert parse_wait_s(raw) == seconds


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "soon"])
def test_a_wait_s_that_is_not_a_finite_non_negative_number_is_a_400(raw):
    with pytest.raises(HelexaError) as e:
        parse_wait_s(raw)
    assert e.value.status == 400 and e.value.param == "wait_s"
