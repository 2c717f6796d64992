"""batch.completed webhooks (the batch row as that event's outbox), and the delivery log of every
webhook attempt

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
_BATCH_COLUMNS = ("webhook_url", "webhook_events", "webhook_state", "webhook_attempts",
                  "webhook_next_attempt_at")


def upgrade() -> None:
    # Nullable, or with a server default: the batches made before have no webhook.
    op.add_column("batches", sa.Column("webhook_url", sa.String(length=2048), nullable=True))
    op.add_column("batches", sa.Column("webhook_events", sa.JSON(), nullable=True))
    op.add_column("batches", sa.Column("webhook_state", sa.String(length=16), nullable=True))
    op.add_column("batches", sa.Column("webhook_attempts", sa.Integer(), server_default="0",
                                       nullable=False))
    op.add_column("batches", sa.Column("webhook_next_attempt_at", TS, nullable=True))
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True,
                  nullable=False),
        sa.Column("job_id", sa.String(length=20), nullable=True),
        sa.Column("batch_id", sa.String(length=20), nullable=True),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("msg_id", sa.String(length=100), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE",
                                name=op.f("fk_webhook_attempts_job_id_jobs")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE",
                                name=op.f("fk_webhook_attempts_batch_id_batches")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_attempts")),
    )
    op.create_index("ix_webhook_attempts_job_id_id", "webhook_attempts", ["job_id", "id"])
    op.create_index("ix_webhook_attempts_batch_id_id", "webhook_attempts", ["batch_id", "id"])


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("batches") as batch:
        for name in _BATCH_COLUMNS:
            batch.drop_column(name)
