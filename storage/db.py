"""Engines and sessions: one place that knows how SQLite and PostgreSQL differ at connect time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; for a SQLite file, its directory is created and WAL mode is on."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        # The API's thread pool hands one connection between threads; SQLite must allow it.
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    # A connection that died while pooled (a database restart) is replaced at checkout, so the
    # first requests after an outage succeed instead of failing on a dead socket.
    kwargs.setdefault("pool_pre_ping", True)
    # A server that drops packets instead of refusing would hold a request for the kernel's TCP
    # timeout (minutes); this bounds the wait.
    kwargs.setdefault("connect_args", {"connect_timeout": 10})
    kwargs.setdefault("pool_size", 20)
    kwargs.setdefault("max_overflow", 20)
    return create_engine(url, **kwargs)


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    # WAL lets the API read while a worker process writes; the busy timeout makes writers wait
    # for each other instead of failing with "database is locked".
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: routes return rows after committing them.
    return sessionmaker(engine, expire_on_commit=False)


def autocommit(session: Session) -> Connection:
    """The session's connection in autocommit mode, for ONE statement that is atomic on its own
    (PostgreSQL runs each statement in a transaction of its own): no ``BEGIN`` and ``COMMIT``
    round trips around it. A read transaction the session has open is committed first. Call
    ``session.commit()`` after the statement to give the connection back."""
    if session.in_transaction():
        session.commit()
    return session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
