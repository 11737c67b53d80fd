"""catalogue revision: the hub branch, tag or commit a model's cold loads fetch

`catalogue_models` gains `revision`, the node's `POST /models/load` option of that name.
NULL, as every existing row gets: the repository's main branch, as before.

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


def upgrade() -> None:
    # batch: SQLite rebuilds the table where it cannot alter it in place (env.py)
    with op.batch_alter_table("catalogue_models") as batch:
        batch.add_column(sa.Column("revision", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("catalogue_models") as batch:
        batch.drop_column("revision")
