"""prompt-cache pricing: the catalogue's cache prices, the ledger's cache-written tokens

`catalogue_models` gains `cost_cache_read` and `cost_cache_write` (USD per 1M prompt tokens
read from / stored in a node's prefix cache; NULL, as every existing row gets: the input
price, so nothing already booked would have cost otherwise). `spend_ledger` gains
`cache_write_tokens` (0 for existing rows: nothing was counted), and its three covering
indexes carry `cached_tokens` too, so the console's cached totals stay index-only scans.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29 01:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PRICES = ("cost_cache_read", "cost_cache_write")
OLD_SUMS = ["prompt_tokens", "completion_tokens", "cost_usd"]
NEW_SUMS = ["prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd"]
INDEXES = (
    ("ix_spend_ledger_ts_sums", ["ts"]),
    ("ix_spend_ledger_key_ts_sums", ["key_id", "ts"]),
    ("ix_spend_ledger_model_ts_sums", ["model", "ts"]),
)


def _indexes(sums: list[str]) -> None:
    for name, columns in INDEXES:
        op.drop_index(name, table_name="spend_ledger")
        op.create_index(name, "spend_ledger", [*columns, *sums])


def upgrade() -> None:
    # batch: SQLite rebuilds the table where it cannot alter it in place (env.py)
    with op.batch_alter_table("catalogue_models") as batch:
        for name in PRICES:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    with op.batch_alter_table("spend_ledger") as batch:
        batch.add_column(
            sa.Column("cache_write_tokens", sa.Integer(), nullable=False, server_default="0")
        )
    _indexes(NEW_SUMS)


def downgrade() -> None:
    _indexes(OLD_SUMS)
    with op.batch_alter_table("spend_ledger") as batch:
        batch.drop_column("cache_write_tokens")
    with op.batch_alter_table("catalogue_models") as batch:
        for name in reversed(PRICES):
            batch.drop_column(name)
