"""Engines, sessions and migrations: the only place that knows how to open the database.

SQLite (the default) gets WAL, a busy timeout and enforced foreign keys on every
connection. PostgreSQL is reached through psycopg 3 (`pip install 'helexa[postgres]'`): a
plain `postgresql://` URL is read as `postgresql+psycopg://`, and connections give up after
a few seconds when the server cannot be reached. Any other SQLAlchemy URL passes through.
The schema is Alembic's (`helexa/db/migrations/`, shipped in the wheel), run here
programmatically.

Alembic is imported when a migration runs, with its logger at WARNING: it announces each
of its plugins at INFO on import, which would top every gateway start-up log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from helexa.config import Config

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"  # in the wheel too
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",  # readers never block the ledger writer
    "PRAGMA busy_timeout=5000",
    "PRAGMA foreign_keys=ON",
    "PRAGMA synchronous=NORMAL",  # durable across process crashes under WAL; fast
)
PG_CONNECT_TIMEOUT_S = 5  # a gateway whose database is down says so, rather than hang


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def resolve_url(url: str) -> URL:
    """`url` parsed, with PostgreSQL on psycopg 3 when it names no driver: SQLAlchemy's
    default for `postgresql://` is psycopg2, which helexa does not install. `postgres://`
    (as some hosting providers write it) is taken for `postgresql://`."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite files get their directory created and the pragmas above,
    PostgreSQL connections a connect timeout (unless the URL sets its own) and a liveness
    check on checkout (a restarted server or a dropped idle connection costs no request)."""
    parsed = resolve_url(url)
    if parsed.get_backend_name() == "postgresql":
        connect_args: dict[str, object] = {}
        if parsed.get_driver_name() in ("psycopg", "psycopg2") and (
            "connect_timeout" not in parsed.query
        ):
            connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
        try:
            return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
        except ModuleNotFoundError as e:  # the driver is imported here, not at the first query
            raise ModuleNotFoundError(
                f"{e}: PostgreSQL needs its driver, pip install 'helexa[postgres]'", name=e.name
            ) from e
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    database = parsed.database or ""
    in_memory = database in ("", ":memory:") or parsed.query.get("mode") == "memory"
    if in_memory:  # one shared connection, or every checkout would see an empty database
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, poolclass=StaticPool
        )
    else:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _set_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        for pragma in SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (handlers return them)."""
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str, connection: Connection | None = None) -> AlembicConfig:
    """Alembic's configuration for `url`, without reading alembic.ini."""
    with _quiet(logging.getLogger("alembic")):
        from alembic.config import Config as AlembicConfig
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser interpolation
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _migrate(engine: Engine, step: Literal["upgrade", "downgrade"], revision: str) -> None:
    """Run an Alembic command on one of `engine`'s connections and commit it."""
    with _quiet(logging.getLogger("alembic")):
        from alembic import command
    url = engine.url.render_as_string(hide_password=False)
    with engine.connect() as conn:
        getattr(command, step)(alembic_config(url, conn), revision)
        conn.commit()
        if conn.dialect.name == "sqlite":  # env.py turned it off; this connection goes back
            conn.exec_driver_sql("PRAGMA foreign_keys=ON")  # to the pool
            conn.commit()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` forward to `revision`."""
    engine = make_engine(url)
    try:
        _migrate(engine, "upgrade", revision)
    finally:
        engine.dispose()


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at `url` back to `revision` ("base": drop everything)."""
    engine = make_engine(url)
    try:
        _migrate(engine, "downgrade", revision)
    finally:
        engine.dispose()


def current(url: str) -> str | None:
    """The database's revision, or None when it has never been migrated."""
    file = make_url(url).database or ""
    if is_sqlite(url) and file not in ("", ":memory:") and not Path(file).expanduser().exists():
        return None  # don't create the file just to look
    with _quiet(logging.getLogger("alembic")):
        from alembic.runtime.migration import MigrationContext
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def open_database(cfg: Config) -> tuple[Engine, sessionmaker[Session]]:
    """The gateway's database, migrated to head, and a session factory over it. Alembic's
    per-step INFO lines stay out of the start-up log (`helexa db upgrade` says what ran)."""
    engine = make_engine(cfg.gateway.database_url)
    with _quiet(logging.getLogger("alembic")):
        _migrate(engine, "upgrade", "head")
    return engine, session_factory(engine)


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """`logger` at WARNING or above for the duration."""
    level = logger.level
    logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        logger.setLevel(level)
