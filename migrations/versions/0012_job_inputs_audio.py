"""jobs: the input file a render starts from, how it is fitted and what it is for, the video
it was made from, video-to-video strength, and the soundtrack (asked for, and written)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("input_file_id", sa.String(length=20), nullable=True))
        batch.add_column(sa.Column("input_fit", sa.String(length=8), nullable=True))
        batch.add_column(sa.Column("input_role", sa.String(length=8), nullable=True))
        batch.add_column(sa.Column("source_job_id", sa.String(length=20), nullable=True))
        batch.add_column(sa.Column("strength", sa.Float(), nullable=True))
        batch.add_column(sa.Column("audio", sa.Boolean(), nullable=True))
        batch.add_column(sa.Column("has_audio", sa.Boolean(), nullable=True))
        batch.create_foreign_key(op.f("fk_jobs_input_file_id_input_files"), "input_files",
                                 ["input_file_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("fk_jobs_input_file_id_input_files"), type_="foreignkey")
        batch.drop_column("has_audio")
        batch.drop_column("audio")
        batch.drop_column("strength")
        batch.drop_column("source_job_id")
        batch.drop_column("input_role")
        batch.drop_column("input_fit")
        batch.drop_column("input_file_id")
