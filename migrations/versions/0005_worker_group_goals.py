"""the goal a worker group declares: latency (interactive jobs first) or throughput (batch jobs
first)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: a group that reported before goals existed reads as having none.
    op.add_column("worker_groups", sa.Column("goal", sa.String(length=32), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("worker_groups") as batch:
        batch.drop_column("goal")
