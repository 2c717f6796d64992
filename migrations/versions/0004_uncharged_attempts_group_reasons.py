"""uncharged attempts (attempts a job was handed back from without being charged for them)
and the reason a worker group gives for its state

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("uncharged_attempts", sa.Integer(), nullable=False,
                                    server_default="0"))
    op.add_column("worker_groups", sa.Column("state_reason", sa.String(length=500),
                                             nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("worker_groups") as batch:
        batch.drop_column("state_reason")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("uncharged_attempts")
