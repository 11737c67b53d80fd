"""bench history: every `helexa bench run` and each sample it took

- `bench_runs`: one per run against one target, with the build the target reported
  (`/version`: its git sha and dirty flag, or its version where it has no sha).
- `bench_samples`: one per measurement, keyed by (target, sha, dirty, model, scenario), the
  cell a run skips once it holds `--samples` of them; the console charts them per version.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 03:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "bench_runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("target_url", sa.String(1000), nullable=False),
        sa.Column("sha", sa.String(100), nullable=False),
        sa.Column("dirty", sa.Boolean(), nullable=False),
        sa.Column("build", sa.JSON(), nullable=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("quick", sa.Boolean(), nullable=False),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("finished_at", TZ, nullable=True),
    )
    op.create_index("ix_bench_runs_target", "bench_runs", ["target"])
    op.create_table(
        "bench_samples",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("bench_runs.id"), nullable=False),
        sa.Column("ts", TZ, nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("sha", sa.String(100), nullable=False),
        sa.Column("dirty", sa.Boolean(), nullable=False),
        sa.Column("model", sa.String(500), nullable=False),
        sa.Column("scenario", sa.String(100), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("decode_tok_s", sa.Float(), nullable=True),
        sa.Column("tok_s", sa.Float(), nullable=True),
        sa.Column("req_s", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("wall_s", sa.Float(), nullable=False),
    )
    op.create_index("ix_bench_samples_run_id", "bench_samples", ["run_id"])
    op.create_index(
        "ix_bench_samples_cell", "bench_samples", ["target", "model", "scenario", "sha", "dirty"]
    )


def downgrade() -> None:
    op.drop_index("ix_bench_samples_cell", table_name="bench_samples")
    op.drop_index("ix_bench_samples_run_id", table_name="bench_samples")
    op.drop_table("bench_samples")
    op.drop_index("ix_bench_runs_target", table_name="bench_runs")
    op.drop_table("bench_runs")
