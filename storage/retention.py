"""Retention: finding jobs whose outputs have been kept long enough, and marking them purged;
finding uploaded input files kept as long.

A job's row stays (accounting, history, the owner can still see what they asked for); only the
video and thumbnail go. An input file goes whole, its row with its object. Either way the caller
deletes the objects from the store first and changes the row after, so a crash in between leaves
a row that the next run finds again (deleting an absent object is not an error) instead of
objects that no row points to any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, or_, select, update
from sqlalchemy.orm import Session

from storage.tables import TERMINAL_STATES, InputFile, Job, JobEvent, utcnow

_TERMINAL = [s.value for s in TERMINAL_STATES]


@dataclass(frozen=True, slots=True)
class Outputs:
    job_id: str
    keys: tuple[str, ...]  # the store keys to delete


def expired_outputs(session: Session, *, finished_before: datetime,
                    limit: int = 200) -> list[Outputs]:
    """Finished jobs (oldest first) that ended before ``finished_before`` and still hold
    outputs."""
    stmt = (
        select(Job.id, Job.output_video_key, Job.output_thumbnail_key)
        .where(Job.finished_at < finished_before, Job.state.in_(_TERMINAL),
               or_(Job.output_video_key.is_not(None), Job.output_thumbnail_key.is_not(None)))
        .order_by(Job.finished_at)
        .limit(limit)
    )
    found = [Outputs(job_id, tuple(k for k in (video, thumb) if k is not None))
             for job_id, video, thumb in session.execute(stmt)]
    session.rollback()  # end the read transaction
    return found


def mark_purged(session: Session, outputs: Outputs, *, now: datetime | None = None) -> bool:
    """Clears the job's output keys (after the objects were deleted) with a ``purged`` event;
    commits. False if the row no longer names those outputs."""
    now = now or utcnow()
    stmt = (
        update(Job)
        .where(Job.id == outputs.job_id, Job.state.in_(_TERMINAL),
               or_(Job.output_video_key.is_not(None), Job.output_thumbnail_key.is_not(None)))
        .values(output_video_key=None, output_thumbnail_key=None)
        .returning(Job.attempts)
        .execution_options(synchronize_session=False)
    )
    row = session.execute(stmt).one_or_none()
    if row is None:
        session.rollback()
        return False
    session.execute(insert(JobEvent).values(
        job_id=outputs.job_id, at=now, kind="purged", attempt=row[0],
        detail={"reason": "retention", "keys": list(outputs.keys)}))
    session.commit()
    return True


def expired_inputs(session: Session, *, created_before: datetime,
                   limit: int = 200) -> list[tuple[str, str]]:
    """(file id, store key) of the input files (oldest first) uploaded before
    ``created_before``; the caller deletes each object, then the row
    (`storage.input_files.forget_input_file`)."""
    stmt = (select(InputFile.id, InputFile.storage_key)
            .where(InputFile.created_at < created_before)
            .order_by(InputFile.created_at).limit(limit))
    found = [(file_id, key) for file_id, key in session.execute(stmt)]
    session.rollback()  # end the read transaction
    return found
