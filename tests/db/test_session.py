"""How helexa opens a database: which driver a URL gets and what its connections are told."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from helexa.db.session import PG_CONNECT_TIMEOUT_S, make_engine, resolve_url


class _Captured(Exception):
    pass


def _connect_params(engine: Engine) -> dict[str, Any]:
    """The keyword arguments the driver's connect() would get, without connecting."""
    seen: dict[str, Any] = {}

    @event.listens_for(engine, "do_connect")
    def _capture(_dialect, _record, _cargs, cparams) -> None:  # type: ignore[no-untyped-def]
        seen.update(cparams)
        raise _Captured

    with pytest.raises(_Captured):
        engine.connect()
    return seen


@pytest.mark.parametrize(
    "url",
    ["postgresql://u:p@db.internal/helexa", "postgres://u:p@db.internal/helexa"],
)
def test_a_postgresql_url_without_a_driver_uses_psycopg_3(url: str) -> None:
    # SQLAlchemy's default driver for postgresql:// is psycopg2, which helexa does not install
    assert resolve_url(url).drivername == "postgresql+psycopg"
    engine = make_engine(url)
    try:
        assert engine.dialect.name == "postgresql"
        assert engine.dialect.driver == "psycopg"
        assert engine.url.render_as_string(hide_password=False) == (
            "postgresql+psycopg://u:p@db.internal/helexa"
        )
    finally:
        engine.dispose()


def test_a_named_driver_and_other_databases_are_left_as_written() -> None:
    assert resolve_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"
    assert resolve_url("postgresql+psycopg2://u@h/d").drivername == "postgresql+psycopg2"
    assert resolve_url("sqlite:///x.db").drivername == "sqlite"
    assert resolve_url("mysql+pymysql://u@h/d").drivername == "mysql+pymysql"


def test_postgresql_connections_give_up_after_a_connect_timeout() -> None:
    engine = make_engine("postgresql+psycopg://u:p@db.internal/helexa")
    try:
        assert engine.pool._pre_ping  # a dropped connection is replaced, not handed out
        assert _connect_params(engine)["connect_timeout"] == PG_CONNECT_TIMEOUT_S
    finally:
        engine.dispose()


def test_a_connect_timeout_in_the_url_wins() -> None:
    engine = make_engine("postgresql://u:p@db.internal/helexa?connect_timeout=30")
    try:
        assert int(_connect_params(engine)["connect_timeout"]) == 30
    finally:
        engine.dispose()


def test_a_plain_postgresql_url_connects_to_a_real_server(postgres_url: str) -> None:
    engine = make_engine(postgres_url.replace("postgresql+psycopg://", "postgresql://", 1))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() in postgres_url
    finally:
        engine.dispose()
