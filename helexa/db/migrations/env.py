"""Alembic's entry point: run by `helexa.db.session` (which hands over a connection) or by
the `alembic` command from the repository root (which names only a URL)."""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from helexa.db.models import Base
from helexa.db.session import is_sqlite, make_engine

config = context.config
if config.config_file_name is not None:  # the alembic command; helexa keeps its own logging
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata
# PostgreSQL: an advisory lock held by the migrating transaction, so that gateways starting
# together on one database migrate it one at a time (the later ones then find it at head);
# without it they race to create the same tables and all but one fail.
PG_MIGRATION_LOCK = 0x68656C657861  # "helexa"


def database_url() -> str:
    """The Alembic config's URL, else HELEXA_DATABASE_URL, else helexa's configured one."""
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("HELEXA_DATABASE_URL")
    if url:
        return url
    from helexa.config import load_config

    return load_config().gateway.database_url


def run_migrations(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A batch "move and copy" drops and recreates tables; with foreign keys enforced that
        # would cascade or fail. The pragma is a no-op inside a transaction, so set it first.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        compare_type=True,
    )
    try:
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":  # released when the transaction ends
                connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK})")
            context.run_migrations()
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")


def run_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=is_sqlite(url),
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            run_migrations(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
