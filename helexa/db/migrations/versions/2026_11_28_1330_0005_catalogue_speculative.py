"""catalogue speculative decoding: each model's choice, sent in its cold load

`catalogue_models` gains the node's `POST /models/load` speculative options (vLLM's names):
`speculative_method` ("ngram", "draft_model" or "off"), `speculative_model` (the draft
model's id, with "draft_model" only) and `num_speculative_tokens`. NULL, as every existing
row gets: the node's own [engine] setting, as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 13:30:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("speculative_method", sa.String(20)),
    ("speculative_model", sa.String(500)),
    ("num_speculative_tokens", sa.Integer()),
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
