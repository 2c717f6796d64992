"""live webhook retries: a job.started or job.progress event owed another attempt

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # No rows: one is written when a live event's attempt fails and is to be tried again.
    op.create_table(
        "live_webhook_retries",
        sa.Column("msg_id", sa.String(length=100), nullable=False),
        sa.Column("job_id", sa.String(length=20), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE",
                                name=op.f("fk_live_webhook_retries_job_id_jobs")),
        sa.PrimaryKeyConstraint("msg_id", name=op.f("pk_live_webhook_retries")),
    )
    op.create_index("ix_live_webhook_retries_next_attempt_at", "live_webhook_retries",
                    ["next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_live_webhook_retries_next_attempt_at", table_name="live_webhook_retries")
    op.drop_table("live_webhook_retries")
