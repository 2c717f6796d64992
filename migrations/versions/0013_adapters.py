"""LoRA adapters (registered files, each checked against its model), and a job's adapters

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=20), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("model", sa.String(length=100), nullable=False),
        sa.Column("family", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("storage_key", sa.String(length=255), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE",
                                name=op.f("fk_adapters_owner_id_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
    )
    op.create_index("uq_adapters_owner_name", "adapters", ["owner_id", "name"], unique=True,
                    postgresql_where=sa.text("owner_id IS NOT NULL"),
                    sqlite_where=sa.text("owner_id IS NOT NULL"))
    op.create_index("uq_adapters_shared_name", "adapters", ["name"], unique=True,
                    postgresql_where=sa.text("owner_id IS NULL"),
                    sqlite_where=sa.text("owner_id IS NULL"))
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("adapters", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("adapters")
    op.drop_index("ix_adapters_sha256", table_name="adapters")
    op.drop_index("uq_adapters_shared_name", table_name="adapters")
    op.drop_index("uq_adapters_owner_name", table_name="adapters")
    op.drop_table("adapters")
