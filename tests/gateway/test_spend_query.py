"""The Spend page's queries on a real SQLite ledger built by Alembic: filters, keyset
paging both ways, totals, time buckets, and each key's spend against its cap."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from helexa.db.models import SpendRecord
from helexa.gateway.keys import KeyStore
from helexa.gateway.spend_query import (
    ANONYMOUS,
    SpendFilter,
    add_up,
    grand_total,
    key_usage,
    ledger_page,
    over_time,
    pick_step,
    totals_by,
)

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def add_rows(sessions, rows: list[dict]) -> None:
    with sessions.begin() as s:
        s.add_all(
            SpendRecord(
                **{"model": "m", "status": 200, "prompt_tokens": 10, "completion_tokens": 5} | r
            )
            for r in rows
        )


@pytest.fixture
def ledger(sessions):
    """120 rows, one a minute up to NOW: key a (acme, model x) on even minutes, key b
    (beta, model y) on odd ones, every tenth one anonymous."""
    rows = []
    for i in range(120):
        ts = NOW - timedelta(minutes=119 - i)
        if i % 10 == 0:
            rows.append({"ts": ts, "model": "x", "cost_usd": 0.0})
        elif i % 2 == 0:
            rows.append(
                {"ts": ts, "key_id": "a", "account_id": "acme", "model": "x", "cost_usd": 0.01}
            )
        else:
            rows.append(
                {"ts": ts, "key_id": "b", "account_id": "beta", "model": "y", "cost_usd": 0.02}
                | {"cached_tokens": 4, "cache_write_tokens": 2}
            )
    add_rows(sessions, rows)
    return sessions


def test_the_first_page_is_the_newest_rows_and_paging_walks_back_then_forth(ledger):
    with ledger() as s:
        first = ledger_page(s, SpendFilter(), limit=50)
        assert [r.ts for r in first.rows] == sorted((r.ts for r in first.rows), reverse=True)
        assert first.rows[0].ts == NOW and first.newer is None and first.older is not None
        second = ledger_page(s, SpendFilter(), before=first.older, limit=50)
        third = ledger_page(s, SpendFilter(), before=second.older, limit=50)
        assert len(third.rows) == 20 and third.older is None and third.newer is not None
        seen = [r.id for p in (first, second, third) for r in p.rows]
        assert len(seen) == len(set(seen)) == 120
        back = ledger_page(s, SpendFilter(), after=third.newer, limit=50)
        assert [r.id for r in back.rows] == [r.id for r in second.rows]
        top = ledger_page(s, SpendFilter(), after=back.newer, limit=50)
        assert [r.id for r in top.rows] == [r.id for r in first.rows] and top.newer is None


def test_filters_by_key_account_model_and_time_range(ledger):
    with ledger() as s:
        only_b = ledger_page(s, SpendFilter(key_id="b"), limit=500).rows
        assert len(only_b) == 60 and {r.key_id for r in only_b} == {"b"}
        assert {
            r.account_id for r in ledger_page(s, SpendFilter(account_id="acme"), limit=500).rows
        } == {"acme"}
        anonymous = ledger_page(s, SpendFilter(key_id=ANONYMOUS), limit=500).rows
        assert len(anonymous) == 12 and all(r.key_id is None for r in anonymous)
        model_x = grand_total(s, SpendFilter(model="x"))
        assert model_x.requests == 60
        last_hour = SpendFilter(since=NOW - timedelta(minutes=59, seconds=30), until=NOW)
        rows = ledger_page(s, last_hour, limit=500).rows
        assert len(rows) == 59 and max(r.ts for r in rows) < NOW  # until is exclusive


def test_totals_per_key_and_per_model_biggest_spender_first(ledger):
    with ledger() as s:
        by_key = totals_by(s, SpendFilter(), "key_id")
        assert [t.name for t in by_key] == ["b", "a", None]
        b = by_key[0]
        assert (b.requests, b.prompt_tokens, b.completion_tokens) == (60, 600, 300)
        assert b.cached_tokens == 240 and by_key[1].cached_tokens == 0
        assert b.cost_usd == pytest.approx(1.2) and b.tokens == 900
        by_model = totals_by(s, SpendFilter(), "model")
        assert {t.name: t.requests for t in by_model} == {"x": 60, "y": 60}
        total = grand_total(s, SpendFilter())
        summed = add_up(totals_by(s, SpendFilter(), "model", top=None))
        assert (summed.requests, summed.tokens) == (total.requests, total.tokens)
        assert summed.cost_usd == pytest.approx(total.cost_usd)
        assert total.requests == 120 and total.cost_usd == pytest.approx(1.2 + 48 * 0.01)
        assert total.cached_tokens == summed.cached_tokens == 240
        newest = ledger_page(s, SpendFilter(key_id="b"), limit=1).rows[0]
        assert (newest.cached_tokens, newest.cache_write_tokens) == (4, 2)


def test_spend_over_time_is_bucketed_on_round_times_with_empty_buckets_as_zero(ledger):
    with ledger() as s:
        series = over_time(s, SpendFilter(since=NOW - timedelta(hours=4)), NOW)
    assert series.step_s == 300 and len(series.buckets) == 48
    assert all(b.start.minute % 5 == 0 for b in series.buckets)
    assert sum(b.requests for b in series.buckets) == 119  # NOW itself is the end, not in
    assert sum(b.tokens for b in series.buckets[:24]) == 0  # the first two hours: nothing
    assert series.buckets[-1].tokens == 5 * 15


def test_the_chart_step_grows_with_the_range():
    assert pick_step(3600) == 300
    assert pick_step(40 * 60) == 60
    assert pick_step(86400) == 3600
    assert pick_step(30 * 86400) == 86400
    assert pick_step(5 * 365 * 86400) % (7 * 86400) == 0


def test_a_key_spends_against_its_cap_over_its_own_window(sessions):
    store = KeyStore(sessions)
    balance, _ = store.create("acme", cap_tokens=1000)
    rolling, _ = store.create("acme", cap_tokens=1000, window="rolling:3600")
    plain, _ = store.create("acme")
    old, recent = NOW - timedelta(hours=3), NOW - timedelta(minutes=5)
    add_rows(
        sessions,
        [
            {"ts": old, "key_id": balance.id, "cost_usd": 0.5},
            {"ts": recent, "key_id": balance.id, "cost_usd": 0.5},
            {"ts": old, "key_id": rolling.id, "cost_usd": 0.5},
            {"ts": recent, "key_id": rolling.id, "cost_usd": 0.25},
        ],
    )
    with sessions() as s:
        usage = key_usage(s, store.list(), NOW)
    assert (usage[balance.id].tokens, usage[balance.id].cost_usd) == (30, 1.0)
    assert (usage[rolling.id].tokens, usage[rolling.id].cost_usd) == (15, 0.25)
    assert (usage[plain.id].tokens, usage[plain.id].cost_usd) == (0, 0.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"since": "yesterday"}, "since: 'yesterday' is neither a date"),
        ({"until": "2026-13-01"}, "until: '2026-13-01'"),
        ({"since": "2026-11-02", "until": "2026-11-01"}, "must be before until"),
    ],
)
def test_a_bad_filter_names_its_field(params, message):
    with pytest.raises(ValueError, match=message):
        SpendFilter.parse(params, NOW)


def test_a_filter_reads_spans_dates_and_blanks_and_round_trips_as_parameters():
    f = SpendFilter.parse(
        {"key": " a ", "model": "", "since": "24h", "until": "2026-11-22T11:00"}, NOW
    )
    assert f.key_id == "a" and f.model is None
    assert f.since == NOW - timedelta(hours=24)
    assert f.until == datetime(2026, 11, 22, 11, 0, tzinfo=UTC)
    assert SpendFilter.parse(f.params(), NOW) == f
