"""The gateway's durable state: accounts, keys, budgets, the spend ledger, the catalogue, bench
history.

Every schema change is an Alembic revision in `helexa/db/migrations/`; tests build the
schema with `alembic upgrade head`, never `create_all`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Account(Base):
    """Who pays: keys belong to an account."""

    __tablename__ = "accounts"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # the account's name
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="account")


class ApiKey(Base):
    """An API key: only a hash of its secret is kept, plus a visible prefix to recognise it."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "key_" + hex
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(20))  # first characters of the secret
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)  # None: every model
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    account: Mapped[Account] = relationship(back_populates="keys")
    budget: Mapped[Budget | None] = relationship(back_populates="key", uselist=False)

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class Budget(Base):
    """A key's cap: tokens and/or cost, over its whole life (`balance`) or a rolling window."""

    __tablename__ = "budgets"

    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), primary_key=True)
    cap_tokens: Mapped[int | None] = mapped_column(Integer)
    cap_cost_usd: Mapped[float | None] = mapped_column(Float)
    window: Mapped[str] = mapped_column(String(16), default="balance")  # balance | rolling
    window_seconds: Mapped[int | None] = mapped_column(Integer)  # for rolling
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    key: Mapped[ApiKey] = relationship(back_populates="budget")


_SUMS = ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd")


class SpendRecord(Base):
    """One row per request on which a model ran (anonymous ones too); kept
    `[gateway] ledger_retention_days`."""

    __tablename__ = "spend_ledger"
    # the sums' columns ride along so the admin console's totals are index-only scans
    __table_args__ = (
        Index("ix_spend_ledger_ts_sums", "ts", *_SUMS),
        Index("ix_spend_ledger_key_ts_sums", "key_id", "ts", *_SUMS),
        Index("ix_spend_ledger_account_ts", "account_id", "ts"),
        Index("ix_spend_ledger_model_ts_sums", "model", "ts", *_SUMS),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    account_id: Mapped[str | None] = mapped_column(String(200))
    key_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(500))
    node: Mapped[str | None] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)  # read from the cache
    cache_write_tokens: Mapped[int] = mapped_column(Integer, default=0)  # stored in it
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)


class KeySpend(Base):
    """A key's spend over its whole life, kept beside the ledger in the same transaction as
    each of its rows: a balance budget reads one row instead of summing the ledger."""

    __tablename__ = "key_spend"

    key_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)


class GatewayInstance(Base):
    """A running gateway process: its heartbeat is the lease on its reservations."""

    __tablename__ = "gateway_instances"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Reservation(Base):
    """A request's upper bound, held against its key's cap until it is settled. A
    reservation whose gateway stopped renewing its lease is booked as spent, whole."""

    __tablename__ = "reservations"
    __table_args__ = (Index("ix_reservations_key", "key_id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(40))
    account_id: Mapped[str] = mapped_column(String(200))
    gateway_id: Mapped[str] = mapped_column(String(40), index=True)
    model: Mapped[str] = mapped_column(String(500))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)  # max_output × n
    cost_usd: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AdminSessionRow(Base):
    """A logged-in admin console session: any gateway on the database serves it, and a
    restart keeps it. Only a hash of the cookie's token is stored."""

    __tablename__ = "admin_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    csrf: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class CatalogueModel(Base):
    """A model the gateway may route to and cold-load (`[[models]]` seeds these)."""

    __tablename__ = "catalogue_models"

    id: Mapped[str] = mapped_column(String(500), primary_key=True)
    source: Mapped[str | None] = mapped_column(String(100))
    quant: Mapped[str | None] = mapped_column(String(50))
    dtype: Mapped[str | None] = mapped_column(String(20))
    tensor_parallel: Mapped[int] = mapped_column(Integer, default=1)
    min_devices: Mapped[int | None] = mapped_column(Integer)
    min_device_vram_mb: Mapped[int | None] = mapped_column(Integer)
    pinned_on: Mapped[list[str]] = mapped_column(JSON, default=list)
    cost_input: Mapped[float] = mapped_column(Float, default=0.0)  # USD per 1M tokens
    cost_output: Mapped[float] = mapped_column(Float, default=0.0)
    # prompt tokens read from / stored in the node's prefix cache; NULL: the input price
    cost_cache_read: Mapped[float | None] = mapped_column(Float)
    cost_cache_write: Mapped[float | None] = mapped_column(Float)
    # the node's `POST /models/load` speculative options; NULL: the node's [engine] setting
    speculative_method: Mapped[str | None] = mapped_column(String(20))
    speculative_model: Mapped[str | None] = mapped_column(String(500))
    num_speculative_tokens: Mapped[int | None] = mapped_column(Integer)
    revision: Mapped[str | None] = mapped_column(String(200))  # NULL: the repo's main
    # the node's KV options for this model; NULL: the node's [engine] setting
    kv_cache_dtype: Mapped[str | None] = mapped_column(String(20))
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    kv_cache_memory_mb: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class Alias(Base):
    __tablename__ = "aliases"

    alias: Mapped[str] = mapped_column(String(500), primary_key=True)
    target: Mapped[str] = mapped_column(String(500))


class Setting(Base):
    """Small facts about the database itself (e.g. that the catalogue was seeded)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(String(1000))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, server_default=func.now()
    )


class BenchRun(Base):
    """One `helexa bench run` against one target: the build it found there, and when."""

    __tablename__ = "bench_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    target: Mapped[str] = mapped_column(String(200), index=True)  # --target-name
    target_url: Mapped[str] = mapped_column(String(1000))
    sha: Mapped[str] = mapped_column(String(100))  # the target's git sha, or its version
    dirty: Mapped[bool] = mapped_column(Boolean, default=False)
    build: Mapped[dict | None] = mapped_column(JSON)  # the target's /version body, as read
    host: Mapped[str] = mapped_column(String(200))  # the machine that ran the bench
    quick: Mapped[bool] = mapped_column(Boolean, default=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BenchSample(Base):
    """One measurement of one scenario: a single streamed chat for the latency scenarios,
    one round of concurrent requests for the throughput ones. A metric a scenario does not
    measure is NULL. (target, sha, dirty, model, scenario) is the cell `--samples` counts."""

    __tablename__ = "bench_samples"
    __table_args__ = (
        Index("ix_bench_samples_cell", "target", "model", "scenario", "sha", "dirty"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("bench_runs.id"), index=True)
    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    target: Mapped[str] = mapped_column(String(200))
    sha: Mapped[str] = mapped_column(String(100))
    dirty: Mapped[bool] = mapped_column(Boolean, default=False)
    model: Mapped[str] = mapped_column(String(500))
    scenario: Mapped[str] = mapped_column(String(100))
    concurrency: Mapped[int] = mapped_column(Integer, default=1)
    requests: Mapped[int] = mapped_column(Integer, default=1)
    prompt_tokens: Mapped[int] = mapped_column(Integer)  # per request, as the target counted
    completion_tokens: Mapped[int] = mapped_column(Integer)  # all requests together
    ttft_ms: Mapped[float | None] = mapped_column(Float)  # median over the requests
    decode_tok_s: Mapped[float | None] = mapped_column(Float)  # one stream's decode rate
    tok_s: Mapped[float | None] = mapped_column(Float)  # completion tokens / wall time
    req_s: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)  # median request latency
    wall_s: Mapped[float] = mapped_column(Float)
