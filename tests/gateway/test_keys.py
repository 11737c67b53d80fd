"""API keys and budgets against a real SQLite file built by Alembic; the CLI as a subprocess."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helexa.db.models import SpendRecord
from helexa.db.session import make_engine, session_factory, upgrade
from helexa.gateway.keys import SECRET_PREFIX, BudgetInfo, KeyStore, hash_secret, parse_window
from helexa.gateway.spend_report import format_spend, parse_since


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "helexa.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def store(db_path: Path):
    engine = make_engine(f"sqlite:///{db_path}")
    yield KeyStore(session_factory(engine))
    engine.dispose()


def key_rows(db_path: Path) -> list[tuple]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT id, account_id, prefix, secret_hash FROM api_keys").fetchall()


def test_create_returns_the_secret_once_and_stores_only_its_hash(store, db_path):
    info, secret = store.create("acme", name="ci")
    assert secret.startswith(SECRET_PREFIX) and len(secret) > 40
    assert info.id.startswith("key_") and len(info.id) == 16
    assert info.account_id == "acme" and info.name == "ci" and info.budget is None
    assert info.prefix == secret[:10] and info.created_at.tzinfo is not None
    [(key_id, account, prefix, stored)] = key_rows(db_path)
    assert (key_id, account, prefix) == (info.id, "acme", secret[:10])
    assert stored == hash_secret(secret) and len(stored) == 64
    assert secret not in db_path.read_bytes().decode("latin-1")
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT id FROM accounts").fetchall() == [("acme",)]


def test_a_second_key_reuses_the_account(store):
    store.create("acme")
    store.create("acme")
    store.create("other")
    assert [k.account_id for k in store.list(account="acme")] == ["acme", "acme"]
    assert len(store.list()) == 3


def test_lookup_finds_the_key_but_not_a_wrong_secret_nor_a_revoked_key(store):
    info, secret = store.create("acme")
    assert store.lookup(secret) == info
    assert store.lookup(secret + "x") is None
    assert store.lookup("hx-nope") is None
    assert store.lookup("") is None
    assert store.revoke(info.id) is True
    assert store.lookup(secret) is None
    assert store.revoke(info.id) is False  # already revoked
    assert store.revoke("key_000000000000") is False  # unknown
    revoked = store.get(info.id)
    assert revoked is not None and revoked.revoked_at is not None and not revoked.is_active


def test_list_can_leave_out_revoked_keys(store):
    a, _ = store.create("acme")
    b, _ = store.create("acme")
    store.revoke(a.id)
    assert [k.id for k in store.list()] == [a.id, b.id]
    assert [k.id for k in store.list(include_revoked=False)] == [b.id]


def test_a_scoped_key_allows_only_its_models_and_an_unscoped_key_allows_all(store):
    scoped, secret = store.create("acme", models=["qwen3-8b", " llama-3.1-8b ", "qwen3-8b"])
    assert scoped.allowed_models == ("qwen3-8b", "llama-3.1-8b")
    found = store.lookup(secret)
    assert found is not None and found.allows("qwen3-8b") and not found.allows("gpt-4o")
    anyone, _ = store.create("acme")
    assert anyone.allowed_models is None and anyone.allows("anything-at-all")
    with pytest.raises(ValueError, match="names no model"):
        store.create("acme", models=["", " "])


def test_a_budget_is_stored_only_when_a_cap_is_given(store, db_path):
    info, secret = store.create("acme", cap_tokens=2000, window="rolling:3600")
    assert info.budget == BudgetInfo(2000, None, "rolling", 3600)
    assert store.lookup(secret).budget == info.budget
    store.create("acme", window="rolling:60")  # no cap: no budget row
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT key_id, window FROM budgets").fetchall() == [
            (info.id, "rolling")
        ]


def test_set_budget_replaces_and_removes_the_budget(store):
    info, secret = store.create("acme", cap_tokens=2000)
    replaced = store.set_budget(info.id, cap_tokens=None, cap_cost_usd=1.5, window="balance")
    assert replaced.budget == BudgetInfo(None, 1.5, "balance", None)
    assert store.get(info.id).budget == replaced.budget
    assert store.lookup(secret).budget == replaced.budget
    removed = store.set_budget(info.id, cap_tokens=None, cap_cost_usd=None, window="balance")
    assert removed.budget is None and store.get(info.id).budget is None
    again = store.set_budget(info.id, cap_tokens=5, cap_cost_usd=None, window="rolling:10")
    assert store.get(info.id).budget == again.budget == BudgetInfo(5, None, "rolling", 10)
    with pytest.raises(KeyError):
        store.set_budget("key_000000000000", cap_tokens=1, cap_cost_usd=None, window="balance")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cap_tokens": 0}, "--cap-tokens must be a positive integer"),
        ({"cap_tokens": -5}, "--cap-tokens must be a positive integer"),
        ({"cap_cost_usd": 0.0}, "--cap-cost must be a positive"),
        ({"cap_cost_usd": float("nan")}, "--cap-cost must be a positive"),
        ({"cap_cost_usd": float("inf")}, "--cap-cost must be a positive"),
        ({"cap_tokens": 10, "window": "weekly"}, "budget window 'weekly'"),
    ],
)
def test_bad_budgets_are_refused_with_the_value_in_the_message(store, kwargs, message):
    with pytest.raises(ValueError, match=message):
        store.create("acme", **kwargs)
    assert store.list() == []


def test_an_empty_account_is_refused(store):
    with pytest.raises(ValueError, match="needs an account"):
        store.create("  ")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("balance", ("balance", None)),
        ("rolling:3600", ("rolling", 3600)),
        ("rolling:1", ("rolling", 1)),
    ],
)
def test_parse_window_accepts_balance_and_rolling_seconds(text, parsed):
    assert parse_window(text) == parsed


@pytest.mark.parametrize(
    "text", ["", "rolling", "rolling:", "rolling:0", "rolling:-5", "rolling:1h", "Balance", "daily"]
)
def test_parse_window_refuses_anything_else(text):
    with pytest.raises(ValueError, match="balance or rolling:SECONDS"):
        parse_window(text)


def add_spend(store: KeyStore, *rows: dict) -> None:
    with store.sessions.begin() as s:
        for r in rows:
            s.add(SpendRecord(**{"status": 200, **r}))


def test_spend_totals_group_by_key_account_and_model_and_filter(store):
    a, _ = store.create("acme")
    b, _ = store.create("beta")
    old = datetime.now(UTC) - timedelta(days=10)
    add_spend(
        store,
        dict(
            key_id=a.id,
            account_id="acme",
            model="m1",
            prompt_tokens=10,
            completion_tokens=5,
            cost_usd=0.01,
        ),
        dict(
            key_id=a.id,
            account_id="acme",
            model="m1",
            prompt_tokens=20,
            completion_tokens=7,
            cached_tokens=8,
            cost_usd=0.02,
        ),
        dict(
            key_id=a.id, account_id="acme", model="m2", prompt_tokens=1, completion_tokens=1, ts=old
        ),
        dict(
            key_id=b.id,
            account_id="beta",
            model="m1",
            prompt_tokens=100,
            completion_tokens=50,
            cost_usd=1.0,
        ),
        dict(key_id=None, account_id=None, model="m1", prompt_tokens=3, completion_tokens=3),
    )
    rows = store.spend_totals()
    by = {(r["key_id"], r["model"]): r for r in rows}
    assert len(rows) == 4
    assert by[(a.id, "m1")] == {
        "key_id": a.id,
        "account_id": "acme",
        "model": "m1",
        "requests": 2,
        "prompt_tokens": 30,
        "cached_tokens": 8,
        "completion_tokens": 12,
        "cost_usd": pytest.approx(0.03),
    }
    assert by[(None, "m1")]["requests"] == 1  # anonymous requests are counted too
    assert {r["model"] for r in store.spend_totals(key_id=a.id)} == {"m1", "m2"}
    assert [r["key_id"] for r in store.spend_totals(account="beta")] == [b.id]
    recent = store.spend_totals(key_id=a.id, since=datetime.now(UTC) - timedelta(days=1))
    assert [(r["model"], r["requests"]) for r in recent] == [("m1", 2)]
    assert store.spend_totals(key_id="key_000000000000") == []

    report = format_spend(rows)
    assert report.splitlines()[-1].split() == ["TOTAL", "5", "134", "8", "66", "1.030000"]


def test_parse_since_takes_dates_and_spans_back_from_now():
    now = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
    assert parse_since("2026-11-01", now) == datetime(2026, 11, 1, tzinfo=UTC)
    assert parse_since("24h", now) == now - timedelta(hours=24)
    assert parse_since("7d", now) == now - timedelta(days=7)
    with pytest.raises(ValueError, match="--since 'yesterday'"):
        parse_since("yesterday", now)


# The command line, end to end.


def helexa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "helexa.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "helexa.toml"
    path.write_text(f'[gateway]\ndatabase_url = "sqlite:///{tmp_path / "cli.db"}"\n')
    return str(path)


def test_the_keys_and_spend_commands_end_to_end(config, tmp_path):
    made = helexa(
        "keys", "create", "--account", "acme", "--name", "ci", "--models", "m1,m2",
        "--cap-tokens", "2000", "--window", "rolling:3600", "--config", config,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    secret = made.stdout.splitlines()[-1]
    assert secret.startswith("hx-") and " " not in secret
    assert "acme" in made.stdout and "m1, m2" in made.stdout and "2000 tokens" in made.stdout
    key_id = next(w for w in made.stdout.split() if w.startswith("key_"))

    listed = helexa("keys", "list", "--config", config)
    assert listed.returncode == 0, listed.stderr
    assert key_id in listed.stdout and secret[:10] in listed.stdout
    assert secret not in listed.stdout and hash_secret(secret) not in listed.stdout
    assert helexa("keys", "list", "--account", "nobody", "--config", config).stdout.count("\n") == 1

    budget = helexa("keys", "set-budget", key_id, "--cap-cost", "2.5", "--config", config)
    assert budget.returncode == 0 and "$2.5 (balance)" in budget.stdout
    removed = helexa("keys", "set-budget", key_id, "--config", config)
    assert removed.returncode == 0 and "budget   none" in removed.stdout

    engine = make_engine(f"sqlite:///{tmp_path / 'cli.db'}")
    add_spend(
        KeyStore(session_factory(engine)),
        dict(
            key_id=key_id,
            account_id="acme",
            model="m1",
            prompt_tokens=40,
            completion_tokens=2,
            cost_usd=0.5,
        ),
    )
    engine.dispose()
    spent = helexa("spend", "--since", "24h", "--config", config)
    assert spent.returncode == 0, spent.stderr
    [line] = [ln for ln in spent.stdout.splitlines() if ln.startswith(key_id)]
    assert line.split()[:7] == [key_id, "acme", "1", "40", "0", "2", "0.500000"]
    assert spent.stdout.splitlines()[-1].split() == ["TOTAL", "1", "40", "0", "2", "0.500000"]
    future = helexa("spend", "--since", "2099-01-01", "--config", config).stdout
    assert future.splitlines()[1:] == [future.splitlines()[-1]]  # only the total
    assert future.splitlines()[-1].split() == ["TOTAL", "0", "0", "0", "0", "0.000000"]

    revoked = helexa("keys", "revoke", key_id, "--config", config)
    assert revoked.returncode == 0 and key_id in revoked.stdout
    again = helexa("keys", "revoke", key_id, "--config", config)
    assert again.returncode == 1 and "already revoked" in again.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["keys", "create", "--account", "a", "--cap-tokens", "0"], "--cap-tokens must be"),
        (["keys", "create", "--account", "a", "--window", "weekly"], "budget window 'weekly'"),
        (["keys", "revoke", "key_000000000000"], "unknown"),
        (["keys", "set-budget", "key_000000000000", "--cap-tokens", "5"], "unknown key"),
        (["spend", "--since", "yesterday"], "--since 'yesterday'"),
    ],
)
def test_bad_input_is_one_clear_line_on_stderr(config, args, message):
    done = helexa(*args, "--config", config)
    assert done.returncode == 1
    assert done.stderr.startswith("helexa: ") and message in done.stderr
    assert "Traceback" not in done.stderr
