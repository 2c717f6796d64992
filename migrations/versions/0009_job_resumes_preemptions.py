"""the step a job's attempt resumed from (a checkpoint of an earlier attempt) and how many times
the job was preempted (suspended on its replica for an interactive job)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, or with a server default: the jobs made before started at step 0, never
    # preempted. (job_events.kind is a plain string: its new kinds, resumed, preempted and
    # continued, need no change.)
    op.add_column("jobs", sa.Column("resumed_from_step", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("preemptions", sa.Integer(), server_default="0",
                                    nullable=False))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preemptions")
        batch.drop_column("resumed_from_step")
