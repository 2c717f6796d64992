"""the webhook events a job asked for (job.started, job.progress, the final ones); NULL: the
final events only

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: the jobs made before keep the final events only, as they had.
    op.add_column("jobs", sa.Column("webhook_events", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("webhook_events")
