"""batch submissions: the window and idempotency key on batches, each job's line in its batch

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("batches", sa.Column("not_before", TS, nullable=True))
    op.add_column("batches", sa.Column("deadline", TS, nullable=True))
    op.add_column("batches", sa.Column("idempotency_key", sa.String(length=255), nullable=True))
    op.add_column("batches", sa.Column("request_hash", sa.String(length=64), nullable=True))
    # A unique index rather than a constraint: SQLite cannot add constraints to a table.
    op.create_index("uq_batches_owner_idempotency_key", "batches",
                    ["owner_id", "idempotency_key"], unique=True)
    op.create_index("ix_batches_owner_created", "batches", ["owner_id", "created_at", "id"])
    op.add_column("jobs", sa.Column("batch_index", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("batch_index")
    op.drop_index("ix_batches_owner_created", table_name="batches")
    op.drop_index("uq_batches_owner_idempotency_key", table_name="batches")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("request_hash")
        batch.drop_column("idempotency_key")
        batch.drop_column("deadline")
        batch.drop_column("not_before")
