"""jobs: what the successful attempt's steps cost (block gathers, blocks computed)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("gathers", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("blocks_computed", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("blocks_computed")
        batch.drop_column("gathers")
