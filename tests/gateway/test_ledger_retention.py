"""The ledger's retention on each database helexa supports (SQLite and a real PostgreSQL):
rows past `[gateway] ledger_retention_days` go, in batches, newer ones stay, and no budget
changes — a balance reads its key's lifetime total, a rolling window its own rows."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from helexa.config import ConfigError, load_config
from helexa.db.models import KeySpend, SpendRecord
from helexa.db.session import make_engine, session_factory
from helexa.gateway.budgets import Budgets
from helexa.gateway.keys import KeyInfo, KeyStore
from helexa.gateway.ledger import Ledger, book_row
from helexa.gateway.retention import Retention
from helexa.gateway.service import build_gateway

NOW = datetime.now(UTC)


def _book(engine: Engine, key: KeyInfo | None, days_ago: float, tokens: int, n: int = 1) -> None:
    with engine.begin() as conn:
        for _ in range(n):
            row = {
                "ts": NOW - timedelta(days=days_ago),
                "key_id": key.id if key else None,
                "account_id": key.account_id if key else None,
                "model": "m",
                "status": 200,
                "prompt_tokens": tokens,
                "completion_tokens": 0,
                "cost_usd": tokens / 1e6,
            }
            book_row(conn, row)


def _left(engine: Engine) -> dict[str | None, list[int]]:
    """Each key's remaining rows, as whole days old."""
    with session_factory(engine)() as s:
        rows = s.execute(select(SpendRecord.key_id, SpendRecord.ts)).all()
    out: dict[str | None, list[int]] = {}
    for key_id, ts in rows:
        ts = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
        out.setdefault(key_id, []).append(round((NOW - ts) / timedelta(days=1)))
    return {k: sorted(v) for k, v in out.items()}


async def _room(budgets: Budgets, keys: list[KeyInfo]) -> list[int]:
    """What each key's budget leaves a request now (its reservation released again)."""
    room = []
    for key in keys:
        res = await budgets.reserve(key, "m", 10, 100_000, (0.0, 0.0))
        assert res is not None
        room.append(res.max_output)
        await budgets.ledger.submit(budgets.release_op(res), keep=True)
    return room


def test_rows_past_the_retention_go_in_batches_and_no_budget_changes(db):
    store = KeyStore(session_factory(db))
    balance, _ = store.create("acme", cap_tokens=10_000)
    long_window, _ = store.create("acme", cap_tokens=10_000, window=f"rolling:{200 * 86400}")
    short_window, _ = store.create("acme", cap_tokens=10_000, window="rolling:86400")
    _book(db, None, 400, 5, n=20)  # anonymous, long gone
    _book(db, None, 10, 5, n=3)
    _book(db, balance, 100, 1000, n=2)
    _book(db, balance, 1, 500)
    _book(db, long_window, 300, 1000)  # outside its 200 days: it goes
    _book(db, long_window, 150, 1000, n=2)  # past the retention, inside its window: it stays
    _book(db, long_window, 1 / 24, 300)
    _book(db, short_window, 95, 700)
    _book(db, short_window, 0.5, 200)
    keys = [balance, long_window, short_window]

    async def main() -> tuple[list[int], list[int], int, list[int]]:
        books = Ledger.over(db)
        books.start()
        budgets = Budgets(books)
        try:
            before = await _room(budgets, keys)
            retention = Retention(books, 90, batch=7)
            write, per_batch = books.write, []

            async def counted(run, **kw):  # type: ignore[no-untyped-def]
                n = await write(run, **kw)
                per_batch.append(n)
                return n

            books.write = counted  # type: ignore[method-assign]
            pruned = await retention.prune()
            books.write = write  # type: ignore[method-assign]
            return before, await _room(budgets, keys), pruned, per_batch
        finally:
            await books.close()

    with session_factory(db)() as s:
        spent_before = {k.key_id: (k.tokens, k.cost_usd) for k in s.scalars(select(KeySpend))}
    before, after, pruned, per_batch = asyncio.run(main())
    assert pruned == 20 + 2 + 1 + 1
    assert sum(per_batch) == pruned and max(per_batch) <= 7 and len(per_batch) >= 4
    assert _left(db) == {
        None: [10, 10, 10],
        balance.id: [1],
        long_window.id: [0, 150, 150],
        short_window.id: [0],
    }
    assert after == before  # what each budget leaves is what it left
    assert before == [10_000 - 2500 - 10, 10_000 - 2300 - 10, 10_000 - 200 - 10]
    with session_factory(db)() as s:
        spent_after = {k.key_id: (k.tokens, k.cost_usd) for k in s.scalars(select(KeySpend))}
    assert spent_after == spent_before  # lifetime totals are not the ledger's rows


def test_replicas_pruning_one_database_together_delete_each_row_once(db):
    _book(db, None, 120, 1, n=60)
    _book(db, None, 1, 1, n=5)

    async def main() -> list[int]:
        writers = [Ledger.over(make_engine(db.url.render_as_string(hide_password=False)))
                   for _ in range(3)]  # fmt: skip
        for w in writers:
            w.start()
        try:
            return await asyncio.gather(*(Retention(w, 90, batch=4).prune() for w in writers))
        finally:
            for w in writers:
                await w.close()
                w.engine.dispose()

    pruned = asyncio.run(main())
    assert sum(pruned) == 60
    assert _left(db) == {None: [1] * 5}


def test_zero_days_keeps_every_row(db):
    _book(db, None, 3650, 1, n=3)

    async def main() -> None:
        books = Ledger.over(db)
        books.start()
        retention = Retention(books, 0, interval_s=0.01)
        retention.start()
        await asyncio.sleep(0.1)
        await retention.stop()
        await books.close()

    asyncio.run(main())
    assert _left(db) == {None: [3650] * 3}


def test_the_gateway_prunes_its_own_ledger_when_it_starts(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'helexa.db'}"
    config = tmp_path / "helexa.toml"
    config.write_text(f'[gateway]\ndatabase_url = "{url}"\nledger_retention_days = 30\n')
    gateway = build_gateway(load_config(config, env={}))  # the database migrated
    engine = make_engine(url)
    _book(engine, None, 31, 1, n=4)
    _book(engine, None, 29, 1)

    async def main() -> int:
        await gateway.start()
        try:
            deadline = time.monotonic() + 10
            while gateway.retention.pruned < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return gateway.retention.pruned
        finally:
            await gateway.stop()

    assert asyncio.run(main()) == 4
    assert _left(engine) == {None: [29]}
    engine.dispose()


def test_the_retention_defaults_to_90_days_and_a_nonsense_value_is_refused(tmp_path: Path):
    config = tmp_path / "helexa.toml"
    config.write_text("[gateway]\n")
    assert load_config(config, env={}).gateway.ledger_retention_days == 90
    for bad in (-1, 36_501):
        config.write_text(f"[gateway]\nledger_retention_days = {bad}\n")
        with pytest.raises(ConfigError, match=f"ledger_retention_days: .* got {bad}"):
            load_config(config, env={})
