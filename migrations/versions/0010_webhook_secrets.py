"""each user's webhook signing secret, and the one it replaced while that still signs

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # No rows: each user's secret is made on first need (storage.webhook_secrets).
    op.create_table(
        "webhook_secrets",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("secret", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("previous_secret", sa.String(length=64), nullable=True),
        sa.Column("previous_until", TS, nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE",
                                name=op.f("fk_webhook_secrets_user_id_users")),
        sa.PrimaryKeyConstraint("user_id", name=op.f("pk_webhook_secrets")),
    )


def downgrade() -> None:
    op.drop_table("webhook_secrets")
