"""catalogue load options: the hub revision and the KV settings a model's cold loads carry

`catalogue_models` gains the node's `POST /models/load` options `revision` (the hub branch,
tag or commit), `kv_cache_dtype`, `max_model_len` and `kv_cache_memory_mb`. NULL, as every
existing row gets: the repository's main branch and the node's [engine] settings, as before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 19:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


COLUMNS = (
    ("revision", sa.String(200)),
    ("kv_cache_dtype", sa.String(20)),
    ("max_model_len", sa.Integer()),
    ("kv_cache_memory_mb", sa.Integer()),
)


def upgrade() -> None:
    # batch: SQLite rebuilds the table where it cannot alter it in place (env.py)
    with op.batch_alter_table("catalogue_models") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("catalogue_models") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
