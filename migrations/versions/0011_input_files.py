"""uploaded input files (images and videos that requests reference by id)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "input_files",
        sa.Column("id", sa.String(length=20), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("content_type", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("num_frames", sa.Integer(), nullable=False),
        sa.Column("duration_seconds", sa.Float(), nullable=True),
        sa.Column("storage_key", sa.String(length=255), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("kind IN ('image', 'video')", name=op.f("ck_input_files_kind")),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE",
                                name=op.f("fk_input_files_owner_id_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_input_files")),
    )
    op.create_index("ix_input_files_owner_created", "input_files",
                    ["owner_id", "created_at", "id"])
    op.create_index("ix_input_files_created", "input_files", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_input_files_created", table_name="input_files")
    op.drop_index("ix_input_files_owner_created", table_name="input_files")
    op.drop_table("input_files")
