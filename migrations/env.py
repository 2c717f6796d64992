"""Alembic environment. The URL comes from, in order: a connection handed in by the caller
(``config.attributes["connection"]``), an explicit ``sqlalchemy.url`` option, kiln's Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from common.settings import Settings
from storage.db import make_engine
from storage.tables import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_offline() -> None:
    url = config.get_main_option("sqlalchemy.url") or Settings().database_url
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url") or Settings().database_url
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
