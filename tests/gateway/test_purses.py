"""Purses (helexa/gateway/purses.py) on each database helexa supports: back-to-back requests
of one key draw on one share of its budget instead of a round trip each, gateways drawing
together never pass a cap, what a request used is taken out of its purse as it is booked,
an idle purse gives its share back, and a purse booked whole by another gateway is never
booked twice."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from helexa.db.models import GatewayInstance, KeySpend, Reservation, SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.errors import HelexaError
from helexa.gateway.budgets import LEASE_EXPIRED, Budgets
from helexa.gateway.keys import KeyStore
from helexa.gateway.ledger import LINGER_S, Ledger
from helexa.gateway.purses import HEADROOM_SHARE, RETIRE_IDLE_S, Purses

PRICE = (1.0, 2.0)  # USD per 1M prompt, output tokens


def _row(key, tokens: tuple[int, int], cost: float = 0.0) -> dict:
    return {"key_id": key.id, "account_id": key.account_id, "model": "m", "status": 200,
            "prompt_tokens": tokens[0], "completion_tokens": tokens[1], "cost_usd": cost}  # fmt: skip


def _reserved(sessions) -> tuple[int, int]:
    """(rows, tokens) in `reservations`."""
    with sessions() as s:
        rows, tokens = s.execute(
            select(
                func.count(),
                func.coalesce(func.sum(Reservation.prompt_tokens + Reservation.output_tokens), 0),
            )
        ).one()
    return rows, int(tokens)


def _spent(sessions, key_id: str) -> tuple[int, int]:
    """(ledger rows, their tokens) of a key; checked against `key_spend`."""
    with sessions() as s:
        rows, tokens = s.execute(
            select(
                func.count(),
                func.coalesce(
                    func.sum(SpendRecord.prompt_tokens + SpendRecord.completion_tokens), 0
                ),
            ).where(SpendRecord.key_id == key_id)
        ).one()
        total = s.get(KeySpend, key_id)
    assert (total.tokens if total else 0) == tokens
    return rows, int(tokens)


async def _idle_out() -> None:
    """Long enough for an idle purse's retirement to be queued and written."""
    await asyncio.sleep(RETIRE_IDLE_S + 3 * LINGER_S + 0.2)


def test_back_to_back_requests_draw_on_one_purse_and_book_exactly(db):
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=10**9)
    sessions = session_factory(db)

    async def main() -> dict:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        Purses(budgets)
        seen: dict = {}
        for i in range(300):
            res = await budgets.purses.draw(key, "m", 40, 16, PRICE)
            assert res is not None and (res.tokens, res.max_output) == (56, 16)
            if i == 150:
                # in use: one row holds this gateway's share, at least what is in flight
                seen["in_use"] = _reserved(sessions)
                seen["outstanding"] = budgets.outstanding()
            budgets.settle(res, _row(key, (40, 10), 0.00006), key.id)
            await asyncio.sleep(0.0005)  # the rest of a request
        seen["grows"] = budgets.purses.grows
        await _idle_out()
        seen["idle"] = _reserved(sessions)
        await books.close()
        return seen

    seen = asyncio.run(main())
    # the first request grows the purse; then it is topped up before it runs dry
    assert seen["grows"] <= 2, seen["grows"]
    rows, tokens = seen["in_use"]
    assert rows == 1 and tokens >= 56
    assert seen["outstanding"] == (56, pytest.approx(40 * 1e-6 + 16 * 2e-6))
    assert seen["idle"] == (0, 0)  # an idle purse gives its share back
    assert _spent(sessions, key.id) == (300, 300 * 50)


def test_many_requests_in_flight_on_one_key_share_the_purses_round_trips(db):
    """16 requests in flight at a time, 800 in all: after the first burst, which finds the
    purse empty, the purse is topped up in the background, and a request that finds it
    short waits for that top-up instead of making a round trip of its own."""
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=10**9)
    sessions = session_factory(db)

    async def main() -> tuple[int, int]:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        Purses(budgets)

        async def client() -> None:
            for _ in range(50):
                res = await budgets.purses.draw(key, "m", 40, 16, PRICE)
                await asyncio.sleep(0.001)  # the node at work
                budgets.settle(res, _row(key, (40, 10), 0.00006), key.id)

        await asyncio.gather(*(client() for _ in range(16)))
        await budgets.stop()
        await books.close()
        return budgets.purses.grows, budgets.purses.top_ups

    grows, top_ups = asyncio.run(main())
    assert grows <= 16 + 2, grows  # the first burst, then (almost) none
    assert top_ups >= 1
    assert _spent(sessions, key.id) == (800, 800 * 50)
    assert _reserved(sessions) == (0, 0)


def test_gateways_drawing_together_never_pass_a_cap(db):
    """Three gateways with their own writers draw on one key from purses, settle what they
    used, and draw again until refused: the books never hold more than the cap, and once
    everything is settled the spend equals what was settled."""
    cap = 5000
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=cap)
    sessions = session_factory(db)
    url = db.url.render_as_string(hide_password=False)

    async def main() -> tuple[int, list[HelexaError], list[int]]:
        writers = [Ledger.over(make_engine(url)) for _ in range(3)]
        budgets = [Budgets(w) for w in writers]
        for b in budgets:
            Purses(b)
        for w in writers:
            w.start()
        used, refusals, peaks = 0, [], []

        async def client(i: int) -> None:
            nonlocal used
            b = budgets[i % 3]
            for _ in range(30):
                try:
                    res = await b.purses.draw(key, "m", 20, 50, (0.0, 0.0))
                except HelexaError as e:
                    refusals.append(e)
                    return
                assert res is not None
                await asyncio.sleep(0.001 * (i % 4))
                spent = 20 + min(res.max_output, 7 + i % 20)  # what "the node" used
                used += spent
                b.settle(res, _row(key, (20, spent - 20)), key.id)
                await asyncio.sleep(0)

        async def watch() -> None:
            while True:
                with sessions() as s:
                    spent = s.scalar(select(func.coalesce(func.sum(KeySpend.tokens), 0)))
                peaks.append(int(spent) + _reserved(sessions)[1])
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.gather(*(client(i) for i in range(24)))
        finally:
            watcher.cancel()
            for b in budgets:
                await b.stop()
            for w in writers:
                await w.close()
        return used, refusals, peaks

    used, refusals, peaks = asyncio.run(main())
    assert refusals, "the cap was never reached"
    assert {e.code for e in refusals} == {"insufficient_quota"}
    assert max(peaks) <= cap  # spent + reserved, as any gateway reads them
    assert _reserved(sessions) == (0, 0)
    _, tokens = _spent(sessions, key.id)
    assert tokens == used <= cap
    assert cap - tokens < 20 + 1 + 24 * 50  # refused only near the cap


def test_near_the_cap_a_purse_holds_no_more_than_the_request_needs(db):
    """A key with room for one bound takes it whole, max_tokens lowered, with no headroom;
    a share of what the cap leaves is all a purse ever grows by past a request's need."""
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=1000)
    sessions = session_factory(db)

    async def main() -> tuple:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        Purses(budgets)
        first = await budgets.purses.draw(key, "m", 100, 5000, (0.0, 0.0))
        reserved = _reserved(sessions)
        budgets.settle(first, _row(key, (100, 300)), key.id)
        await _idle_out()
        second = await budgets.purses.draw(key, "m", 100, 50, (0.0, 0.0))
        second_reserved = _reserved(sessions)
        budgets.settle(second, _row(key, (100, 50)), key.id)
        await budgets.stop()
        await books.close()
        return first, reserved, second_reserved

    first, reserved, second_reserved = asyncio.run(main())
    assert (first.tokens, first.max_output) == (1000, 900)
    assert reserved == (1, 1000)
    # 600 left: the request's 150 and an eighth of the 450 after it
    assert second_reserved == (1, 150 + 450 // HEADROOM_SHARE)
    assert _spent(sessions, key.id) == (2, 550)


def test_a_cost_cap_bounds_a_purse_too(db):
    key, _ = KeyStore(session_factory(db)).create("acme", cap_cost_usd=0.00105)
    sessions = session_factory(db)

    async def main() -> tuple[int, list[int]]:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        Purses(budgets)
        cost, outs = 0.0, []
        try:
            while True:
                res = await budgets.purses.draw(key, "m", 100, 100, PRICE)
                outs.append(res.max_output)
                spent = 100 * 1e-6 + res.max_output * 2e-6
                cost += spent
                budgets.settle(res, _row(key, (100, res.max_output), spent), key.id)
        except HelexaError as e:
            assert e.code == "insufficient_quota"
        await budgets.stop()
        await books.close()
        return cost, outs

    cost, outs = asyncio.run(main())
    assert cost <= 0.00105 + 1e-12
    assert outs[:3] == [100, 100, 100] and 20 < outs[3] <= 25  # lowered to what is left
    with sessions() as s:
        booked = s.scalar(select(func.sum(SpendRecord.cost_usd)))
    assert booked == pytest.approx(cost) and _reserved(sessions) == (0, 0)


def test_a_changed_cap_starts_a_new_purse(db):
    store = KeyStore(session_factory(db))
    key, _ = store.create("acme", cap_tokens=10**6)
    sessions = session_factory(db)

    async def main() -> list:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        Purses(budgets)
        held = await budgets.purses.draw(key, "m", 10, 10, PRICE)
        store.set_budget(key.id, cap_tokens=100)
        lowered = store.get(key.id)
        assert lowered is not None and lowered.budget != key.budget
        # the old purse's free share is not drawn on under the new cap
        refused = None
        try:
            await budgets.purses.draw(lowered, "m", 10, 100, PRICE)
        except HelexaError as e:
            refused = e
        budgets.settle(held, _row(key, (10, 10)), key.id)
        await _idle_out()
        out = _reserved(sessions)
        await books.close()
        return [refused, out]

    refused, out = asyncio.run(main())
    assert refused is not None and refused.code == "insufficient_quota"
    assert out == (0, 0)


def test_a_purse_booked_whole_by_another_gateway_is_never_booked_twice(db):
    """A gateway whose lease ran out (stalled, cut from the database) has its purse booked
    whole by another; its requests in flight then settle to nothing more, and its next
    request starts a new purse from the books."""
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=100_000)
    sessions = session_factory(db)

    async def main() -> tuple:
        stalled, alive = Ledger.over(db), Ledger.over(db)
        stalled.start()
        alive.start()
        gone = Budgets(stalled, lease_s=1.0)
        Purses(gone)
        first = await gone.purses.draw(key, "m", 30, 100, PRICE)
        second = await gone.purses.draw(key, "m", 30, 100, PRICE)  # one purse, still in use
        while any(p.topping for p in gone.purses._open.values()):  # its top-up written
            await asyncio.sleep(0.01)
        purse_tokens = _reserved(sessions)[1]
        with sessions.begin() as s:  # its heartbeat and its purse older than a lease
            old = datetime.now(UTC) - timedelta(seconds=5)
            s.execute(update(Reservation).values(created_at=old))
            s.execute(update(GatewayInstance).values(heartbeat_at=old))
        survivor = Budgets(alive, lease_s=1.0)
        Purses(survivor)
        survivor.start()
        deadline = time.monotonic() + 10
        while not survivor.expired_booked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await survivor.stop()
        # the stalled gateway's request ends: booked whole already, not booked again
        booked = await gone.settle(first, _row(key, (30, 20)), key.id)
        # more than its purse holds: the grow finds the purse gone and starts a new one
        fresh = await gone.purses.draw(key, "m", 2000, 2000, PRICE)
        booked_too = await gone.settle(second, _row(key, (30, 20)), key.id)
        with sessions() as s:
            rows = s.scalars(select(Reservation)).all()
        await stalled.close()
        await alive.close()
        return purse_tokens, (booked, booked_too), fresh, rows

    purse_tokens, booked, fresh, rows = asyncio.run(main())
    assert booked == (False, False)
    with sessions() as s:
        [expired] = s.scalars(select(SpendRecord).where(SpendRecord.key_id == key.id)).all()
    assert expired.finish_reason == LEASE_EXPIRED
    assert expired.prompt_tokens + expired.completion_tokens == purse_tokens
    [row] = rows
    assert fresh.tokens == 4000 and row.output_tokens >= 4000  # a new purse from the books
    assert fresh.purse is not None and row.id == fresh.purse.id
