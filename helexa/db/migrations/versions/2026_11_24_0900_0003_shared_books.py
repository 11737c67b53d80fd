"""books every gateway on the database shares

Budgets move from one process's memory into the database, so any number of gateways on one
database hold a cap together, and a crash never forgets what was reserved:

- `reservations`: each in-flight request's upper bound, tagged with the gateway that holds
  it; a gateway whose heartbeat (`gateway_instances`) goes stale loses its reservations to
  the ledger at their reserved amount.
- `key_spend`: each key's lifetime spend, updated with its ledger rows (backfilled here).
- `admin_sessions`: console logins, so a restart keeps them and any replica serves them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 09:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "key_spend",
        sa.Column("key_id", sa.String(40), primary_key=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
    )
    op.execute(
        "INSERT INTO key_spend (key_id, tokens, cost_usd) "
        "SELECT key_id, SUM(prompt_tokens + completion_tokens), SUM(cost_usd) "
        "FROM spend_ledger WHERE key_id IS NOT NULL GROUP BY key_id"
    )
    op.create_table(
        "gateway_instances",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("heartbeat_at", TZ, nullable=False),
    )
    op.create_table(
        "reservations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("account_id", sa.String(200), nullable=False),
        sa.Column("gateway_id", sa.String(40), nullable=False),
        sa.Column("model", sa.String(500), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
    )
    op.create_index("ix_reservations_key", "reservations", ["key_id"])
    op.create_index("ix_reservations_gateway_id", "reservations", ["gateway_id"])
    op.create_table(
        "admin_sessions",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("expires_at", TZ, nullable=False),
    )
    op.create_index("ix_admin_sessions_expires_at", "admin_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_admin_sessions_expires_at", table_name="admin_sessions")
    op.drop_table("admin_sessions")
    op.drop_index("ix_reservations_gateway_id", table_name="reservations")
    op.drop_index("ix_reservations_key", table_name="reservations")
    op.drop_table("reservations")
    op.drop_table("gateway_instances")
    op.drop_table("key_spend")
