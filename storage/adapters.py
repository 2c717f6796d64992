"""Registered LoRA adapters: their rows, each visible to its owner, the shared ones to everyone.

A registration's bytes go to the output store under their content hash (`adapter_key`) before
its row is committed; a deletion removes the row, then the object unless another registration
holds the same bytes. Another user's adapter is treated as absent everywhere: its id answers like
an id that does not exist. Only admins make or delete shared adapters (``owner_id`` None).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import ColumnElement, delete, func, or_, select
from sqlalchemy.orm import Session

from storage.outputs import adapter_key
from storage.submission import new_job_id
from storage.tables import LoraAdapter, User


def new_adapter(owner: User | None, *, name: str, model: str, family: str, rank: int,
                sha256: str, size_bytes: int) -> LoraAdapter:
    """The row of a checked file (not yet added to a session); ``owner`` None: shared."""
    return LoraAdapter(id=new_job_id(), owner_id=None if owner is None else owner.id, name=name,
                       model=model, family=family, rank=rank, size_bytes=size_bytes,
                       sha256=sha256, storage_key=adapter_key(sha256))


def _visible(user: User) -> ColumnElement[bool]:
    return or_(LoraAdapter.owner_id == user.id, LoraAdapter.owner_id.is_(None))


def get_adapter(session: Session, adapter_id: str, user: User) -> LoraAdapter | None:
    """The user's adapter or a shared one, or None (also for another user's)."""
    return session.scalar(select(LoraAdapter).where(LoraAdapter.id == adapter_id,
                                                    _visible(user)))


def find_by_name(session: Session, name: str, owner: User | None) -> LoraAdapter | None:
    """``owner``'s adapter of that name (``owner`` None: the shared one of that name)."""
    who = (LoraAdapter.owner_id.is_(None) if owner is None
           else LoraAdapter.owner_id == owner.id)
    return session.scalar(select(LoraAdapter).where(LoraAdapter.name == name, who))


def list_adapters(session: Session, user: User, *, model: str | None = None) -> list[LoraAdapter]:
    """The user's adapters and the shared ones (for ``model`` only, if given), by name."""
    stmt = select(LoraAdapter).where(_visible(user))
    if model is not None:
        stmt = stmt.where(LoraAdapter.model == model)
    return list(session.scalars(stmt.order_by(LoraAdapter.name, LoraAdapter.owner_id)))


def forget_adapter(session: Session, row: LoraAdapter) -> bool:
    """Deletes the row and commits; True when no other registration holds its bytes (the
    caller then deletes the object)."""
    session.execute(delete(LoraAdapter).where(LoraAdapter.id == row.id))
    others = session.scalar(select(func.count()).select_from(LoraAdapter)
                            .where(LoraAdapter.sha256 == row.sha256)) or 0
    session.commit()
    return others == 0


#: A lookup of the adapters a caller may use: id -> its model, None for an id that is not theirs
#: nor shared (another user's answers as one that does not exist).
AdapterModels = Callable[[str], str | None]


def models_of(session: Session, user: User) -> AdapterModels:
    def model(adapter_id: str) -> str | None:
        row = get_adapter(session, adapter_id, user)
        return None if row is None else row.model

    return model
