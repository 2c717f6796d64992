"""Which errors mean a server is out (weather: wait and retry), not that a statement is wrong.

The worker group and the API both ask: a refused, dropped or timed-out connection to the
database or Redis, an exhausted connection pool, a locked SQLite file. Anything else (an
integrity error, a bad query) is a bug or a conflict, and retrying would not help.
"""

from __future__ import annotations

import redis.exceptions
import sqlalchemy.exc


def is_database_outage(exc: BaseException) -> bool:
    """``exc`` says the database cannot be reached right now."""
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.TimeoutError
                  | sqlalchemy.exc.DisconnectionError):
        return True
    return isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated


def is_redis_outage(exc: BaseException) -> bool:
    """``exc`` says Redis cannot be reached right now (or went away mid-command)."""
    return isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
                      | redis.exceptions.BusyLoadingError)


def is_outage(exc: BaseException) -> bool:
    return is_database_outage(exc) or is_redis_outage(exc)


def describe(exc: BaseException) -> str:
    """One line for logs and ``/v1/workers``: which server, and what it said."""
    what = "the database" if is_database_outage(exc) else "Redis"
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{what} is unreachable ({type(exc).__name__}: {text[0][:200] if text else ''})"
