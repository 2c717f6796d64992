"""Idempotent creation: a request repeated with the idempotency key its owner already used gets
the row (a job or a batch) that the key made, also when the two requests race.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.tables import Batch, Job

_Keyed = TypeVar("_Keyed", Job, Batch)  # a row that an idempotency key names
_Made = TypeVar("_Made")


class IdempotencyConflict(ValueError):
    """The idempotency key was already used by this user for a different request."""


def create_or_replay(
    session: Session,
    model: type[_Keyed],
    owner_id: int,
    idempotency_key: str | None,
    request_hash: str,
    *,
    create: Callable[[], _Made],
    replay: Callable[[_Keyed], _Made],
) -> _Made:
    """``replay(row)`` for the ``model`` row (a job or a batch) that an earlier request of
    ``owner_id`` made with ``idempotency_key``, else ``create()``, which inserts and commits.

    If a concurrent request with the same key wins the unique constraint, ``create()`` raises
    `IntegrityError`: it is rolled back and the winner's row is replayed. Raises
    `IdempotencyConflict` when the row to replay was made for another request (another
    ``request_hash``); re-raises an `IntegrityError` that no row with the key explains.
    """
    existing = _made_earlier(session, model, owner_id, idempotency_key, request_hash)
    if existing is not None:
        return replay(existing)
    try:
        return create()
    except IntegrityError:
        session.rollback()
        existing = _made_earlier(session, model, owner_id, idempotency_key, request_hash)
        if existing is None:
            raise
        return replay(existing)


def _made_earlier(session: Session, model: type[_Keyed], owner_id: int,
                  idempotency_key: str | None, request_hash: str) -> _Keyed | None:
    if idempotency_key is None:
        return None
    existing = session.scalar(select(model).where(model.owner_id == owner_id,
                                                  model.idempotency_key == idempotency_key))
    if existing is not None and existing.request_hash != request_hash:
        raise IdempotencyConflict(
            "this Idempotency-Key was already used with a different request body"
        )
    return existing
