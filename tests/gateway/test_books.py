"""The books' writer and the budgets on each database helexa supports (SQLite and a real
PostgreSQL): a refused row is dropped alone, writers of several gateways never pass a cap
together, and a stopped gateway's reservations are booked whole when its lease runs out."""

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
from helexa.gateway.ledger import Ledger, book_row


def _row(key_id: str | None = None, tokens: int = 10, **extra) -> dict:
    return {"key_id": key_id, "account_id": "acme" if key_id else None, "model": "m",
            "status": 200, "prompt_tokens": tokens, "completion_tokens": 0, **extra}  # fmt: skip


def test_a_row_the_database_refuses_is_logged_and_dropped_alone(db, caplog):
    async def main() -> tuple[int, int]:
        books = Ledger.over(db)
        books.start()
        good = [books.record(**_row(tokens=n)) for n in (1, 2)]
        bad = books.record(**_row(model=None))  # NOT NULL: the database refuses it
        good += [books.record(**_row(tokens=n)) for n in (3, 4)]
        await asyncio.gather(*good)
        with pytest.raises(Exception):  # noqa: B017  (the driver's IntegrityError)
            await bad
        await books.close()
        return books.state.dropped, books.backlog

    dropped, backlog = asyncio.run(main())
    assert (dropped, backlog) == (1, 0)
    with session_factory(db)() as s:
        assert s.scalars(select(SpendRecord.prompt_tokens).order_by(SpendRecord.id)).all() == [
            1,
            2,
            3,
            4,
        ]
    assert "refused a write to the books; it is dropped" in caplog.text


def test_rows_ending_together_share_one_transaction_and_an_awaited_op_does_not_wait(db):
    """Settlements nobody awaits linger for company; an op its caller awaits (a
    reservation) takes them all with it at once, the plain rows in one statement."""
    keys = KeyStore(session_factory(db))
    a, b = keys.create("acme")[0].id, keys.create("beta")[0].id

    async def main() -> int:
        books = Ledger.over(db)
        books.start()
        owners = [a, b, None, a]
        rows = [books.record(**_row(owners[i % 4], tokens=i + 1)) for i in range(40)]
        assert await books.write(lambda conn: "reserved", timeout=5) == "reserved"
        await asyncio.gather(*rows)
        await books.close()
        return books.state.batches

    assert asyncio.run(main()) == 1
    with session_factory(db)() as s:
        tokens = s.scalars(select(SpendRecord.prompt_tokens)).all()
        assert sorted(tokens) == list(range(1, 41))
        spend = {k.key_id: k.tokens for k in s.scalars(select(KeySpend))}
    assert spend == {
        a: sum(i + 1 for i in range(40) if i % 4 in (0, 3)),
        b: sum(i + 1 for i in range(40) if i % 4 == 1),
    }


def test_gateways_with_their_own_writers_never_pass_a_cap_together(db):
    cap = 1000
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=cap)

    async def main() -> list[object]:
        writers = [Ledger.over(make_engine(db.url.render_as_string(hide_password=False)))
                   for _ in range(3)]  # fmt: skip
        budgets = [Budgets(w) for w in writers]
        for w in writers:
            w.start()
        try:
            return await asyncio.gather(
                *(budgets[i % 3].reserve(key, "m", 20, 50, (0.0, 0.0)) for i in range(60)),
                return_exceptions=True,
            )
        finally:
            for w in writers:
                await w.close()
                w.engine.dispose()

    results = asyncio.run(main())
    held = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, HelexaError)]
    assert len(held) + len(refused) == 60 and refused
    assert {r.code for r in refused} == {"insufficient_quota"}
    assert sum(r.tokens for r in held) <= cap
    with session_factory(db)() as s:
        reserved = s.scalar(select(func.sum(Reservation.prompt_tokens + Reservation.output_tokens)))
    assert reserved == sum(r.tokens for r in held)
    assert cap - reserved < 20 + 1  # the cap is used up: not even one more token fits


def test_a_stopped_gateways_reservations_are_booked_whole_when_its_lease_runs_out(db):
    key, _ = KeyStore(session_factory(db)).create("acme", cap_tokens=10_000)
    sessions = session_factory(db)

    async def main() -> tuple[int, object]:
        dead, alive = Ledger.over(db), Ledger.over(db)
        dead.start()
        alive.start()
        gone = Budgets(dead, lease_s=1.0)
        res = await gone.reserve(key, "m", 30, 100, (1.0, 2.0), n=2)
        await dead.close()  # it never settles, never renews: as if SIGKILLed
        with sessions.begin() as s:  # its reservation and heartbeat are older than a lease
            old = datetime.now(UTC) - timedelta(seconds=5)
            s.execute(update(Reservation).values(created_at=old))
            s.execute(update(GatewayInstance).values(heartbeat_at=old))
        survivor = Budgets(alive, lease_s=1.0)
        survivor.start()
        deadline = time.monotonic() + 10
        while not survivor.expired_booked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await survivor.stop()
        # settling it late does not book it twice
        await alive.submit(gone.settle_op(res, _row(key.id, tokens=5)), keep=True)
        await alive.close()
        return survivor.expired_booked, res

    booked, res = asyncio.run(main())
    assert booked == 1
    with sessions() as s:
        rows = s.scalars(select(SpendRecord).where(SpendRecord.key_id == key.id)).all()
        spent = s.get(KeySpend, key.id)
        assert s.scalar(select(func.count()).select_from(Reservation)) == 0
    [row] = rows
    assert (row.status, row.finish_reason) == (0, LEASE_EXPIRED)
    assert (row.prompt_tokens, row.completion_tokens) == (30, 200)  # 100 for each of n=2
    assert row.prompt_tokens + row.completion_tokens == res.tokens == spent.tokens


def test_a_rolling_window_counts_only_the_spend_inside_it(db):
    sessions = session_factory(db)
    store = KeyStore(sessions)
    key, _ = store.create("acme", cap_tokens=100, window="rolling:3600")
    with db.begin() as conn:
        book_row(conn, _row(key.id, tokens=90, ts=datetime.now(UTC) - timedelta(hours=3)))
        book_row(conn, _row(key.id, tokens=30, ts=datetime.now(UTC) - timedelta(minutes=5)))

    async def main():
        books = Ledger.over(db)
        books.start()
        try:
            first = await Budgets(books).reserve(key, "m", 10, 500, (0.0, 0.0))
            with pytest.raises(HelexaError) as refused:
                await Budgets(books).reserve(key, "m", 10, 500, (0.0, 0.0))
            return first, refused.value
        finally:
            await books.close()

    first, refused = asyncio.run(main())
    assert first.max_output == 100 - 30 - 10  # the 90 of three hours ago left the window
    assert refused.code == "rate_limit_exceeded"
    assert 3000 < refused.retry_after <= 3600  # when the 30 of five minutes ago leaves
