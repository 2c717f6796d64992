"""Uploaded input files: their rows, each visible to its owner only.

An upload's bytes go to the output store (`storage.outputs.input_key`) before its row is
committed, and a deletion removes the object before the row, so a crash in between leaves a row
whose object is gone (deleted again harmlessly, by the owner or by retention) rather than an
object nothing points to. Another user's file is treated as absent everywhere: its id answers
like an id that does not exist.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session

from storage.media import Media
from storage.outputs import input_key
from storage.submission import new_job_id
from storage.tables import InputFile, User


def new_file_id() -> str:
    """20 lowercase letters and digits, like a job id."""
    return new_job_id()


def new_input_file(owner: User, media: Media, *, file_id: str, purpose: str,
                   filename: str | None, size_bytes: int) -> InputFile:
    """The row of a checked upload (not yet added to a session)."""
    return InputFile(
        id=file_id, owner_id=owner.id, kind=media.kind, purpose=purpose,
        content_type=media.content_type, filename=_shown(filename), size_bytes=size_bytes,
        width=media.width, height=media.height, num_frames=media.num_frames,
        duration_seconds=media.duration_seconds,
        storage_key=input_key(file_id, media.extension),
    )


def _shown(filename: str | None) -> str | None:
    """The client's file name as kept for display: its last path part, printable, at most 255
    characters."""
    if not filename:
        return None
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())[:255]
    return name or None


def get_input_file(session: Session, file_id: str, owner: User) -> InputFile | None:
    """The owner's file, or None (also for another user's)."""
    return session.scalar(select(InputFile).where(InputFile.id == file_id,
                                                  InputFile.owner_id == owner.id))


def list_input_files(session: Session, owner: User, *, limit: int,
                     after: InputFile | None = None,
                     newest_first: bool = True) -> tuple[list[InputFile], bool]:
    """A page of the owner's files after ``after`` (in the order asked for), and whether more
    follow."""
    stmt = select(InputFile).where(InputFile.owner_id == owner.id)
    if after is not None:
        if newest_first:
            stmt = stmt.where(or_(InputFile.created_at < after.created_at,
                                  and_(InputFile.created_at == after.created_at,
                                       InputFile.id < after.id)))
        else:
            stmt = stmt.where(or_(InputFile.created_at > after.created_at,
                                  and_(InputFile.created_at == after.created_at,
                                       InputFile.id > after.id)))
    order = ((InputFile.created_at.desc(), InputFile.id.desc()) if newest_first
             else (InputFile.created_at.asc(), InputFile.id.asc()))
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def forget_input_file(session: Session, file_id: str) -> bool:
    """Deletes the row (call after its object was deleted); commits. False if it was gone."""
    deleted = session.execute(delete(InputFile).where(InputFile.id == file_id)
                              .returning(InputFile.id)).first()
    session.commit()
    return deleted is not None


def kinds_of(session: Session, owner: User) -> Callable[[str], str | None]:
    """A lookup of ``owner``'s uploads: file id -> its kind ("image", "video"), None for an id
    that is not one of theirs (another user's answers as one that does not exist)."""

    def kind(file_id: str) -> str | None:
        row = get_input_file(session, file_id, owner)
        return None if row is None else row.kind

    return kind
