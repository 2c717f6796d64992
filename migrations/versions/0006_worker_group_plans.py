"""the layout plan a worker group started from (kiln worker --layout auto): the chosen layout and
the runner-up, with their predicted figures

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: a group whose layout was given on the command line has no plan.
    op.add_column("worker_groups", sa.Column("plan", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite drops columns by rebuilding the table.
    with op.batch_alter_table("worker_groups") as batch:
        batch.drop_column("plan")
