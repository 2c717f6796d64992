"""Alembic environment and revisions: the only way kiln's database schema is created or changed.

`upgrade` is what `kiln db upgrade` and the tests call; it needs no alembic.ini.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

HERE = Path(__file__).resolve().parent


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    """A Config for this package's revisions; ``url`` (or ``connection``) overrides Settings."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    if url is not None:
        # ConfigParser treats % as interpolation; URL-encoded passwords contain it.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade(url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def current_heads() -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config()).get_heads())
