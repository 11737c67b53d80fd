"""initial schema

Tables: accounts, api_keys, budgets, spend_ledger, catalogue_models, aliases, settings.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 03:29:50+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_accounts"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("account_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("prefix", sa.String(length=20), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        # named, so that a later batch migration can refer to them
        sa.ForeignKeyConstraint(
            ["account_id"], ["accounts.id"], name="fk_api_keys_account_id_accounts"
        ),
        sa.UniqueConstraint("secret_hash", name="uq_api_keys_secret_hash"),
    )
    op.create_index("ix_api_keys_account_id", "api_keys", ["account_id"])
    op.create_table(
        "budgets",
        sa.Column("key_id", sa.String(length=40), nullable=False),
        sa.Column("cap_tokens", sa.Integer(), nullable=True),
        sa.Column("cap_cost_usd", sa.Float(), nullable=True),
        sa.Column("window", sa.String(length=16), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key_id", name="pk_budgets"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], name="fk_budgets_key_id_api_keys"),
    )
    op.create_table(
        "spend_ledger",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("account_id", sa.String(length=200), nullable=True),
        sa.Column("key_id", sa.String(length=40), nullable=True),
        sa.Column("model", sa.String(length=500), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("reasoning_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_spend_ledger"),
    )
    op.create_index("ix_spend_ledger_ts", "spend_ledger", ["ts"])
    op.create_index("ix_spend_ledger_key_ts", "spend_ledger", ["key_id", "ts"])
    op.create_index("ix_spend_ledger_account_ts", "spend_ledger", ["account_id", "ts"])
    op.create_index("ix_spend_ledger_model_ts", "spend_ledger", ["model", "ts"])
    op.create_table(
        "catalogue_models",
        sa.Column("id", sa.String(length=500), nullable=False),
        sa.Column("source", sa.String(length=100), nullable=True),
        sa.Column("quant", sa.String(length=50), nullable=True),
        sa.Column("dtype", sa.String(length=20), nullable=True),
        sa.Column("tensor_parallel", sa.Integer(), nullable=False),
        sa.Column("min_devices", sa.Integer(), nullable=True),
        sa.Column("min_device_vram_mb", sa.Integer(), nullable=True),
        sa.Column("pinned_on", sa.JSON(), nullable=False),
        sa.Column("cost_input", sa.Float(), nullable=False),
        sa.Column("cost_output", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalogue_models"),
    )
    op.create_table(
        "aliases",
        sa.Column("alias", sa.String(length=500), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=False),
        sa.PrimaryKeyConstraint("alias", name="pk_aliases"),
    )
    op.create_table(
        "settings",
        sa.Column("key", sa.String(length=100), nullable=False),
        sa.Column("value", sa.String(length=1000), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),  # CURRENT_TIMESTAMP on SQLite, now() on PostgreSQL
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("key", name="pk_settings"),
    )


def downgrade() -> None:
    # children before parents; a table's indexes go with it
    for table in (
        "settings",
        "aliases",
        "catalogue_models",
        "spend_ledger",
        "budgets",
        "api_keys",
        "accounts",
    ):
        op.drop_table(table)
