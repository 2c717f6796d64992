"""What the live event stream (``GET /v1/events``) reads: job events after a cursor, the progress
of running jobs and the worker groups' states. Reads only; every call is one short read.

Job events are read by id. On PostgreSQL ids come from a sequence and are taken at INSERT, not
at COMMIT, so an event can become visible after one with a higher id; `EventCursor` keeps the
ids it has not seen yet below the highest one it has, asks for them again for a while, and only
then counts them as never coming (an id a rolled-back transaction took).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from storage.tables import Job, JobEvent, JobState, User, WorkerGroup

# The state a job is in after an event of each kind; kinds not here change no state.
STATE_AFTER = {
    "created": JobState.QUEUED.value, "claimed": JobState.RUNNING.value,
    "requeued": JobState.QUEUED.value, "succeeded": JobState.SUCCEEDED.value,
    "failed": JobState.FAILED.value, "cancelled": JobState.CANCELLED.value,
    "dead": JobState.DEAD.value, "expired": JobState.EXPIRED.value,
}


@dataclass(frozen=True, slots=True)
class FeedEvent:
    id: int
    job_id: str
    at: datetime
    kind: str
    attempt: int
    detail: dict[str, Any]
    owner_id: int
    batch_id: str | None


@dataclass(slots=True)
class EventCursor:
    """Where a reader is in ``job_events``: every id up to ``watermark`` has been read (or given
    up on); ids above it that were read are in ``seen``. ``watermark`` is what a reader may
    resume from without missing anything."""

    watermark: int
    grace_seconds: float = 30.0
    high: int = field(init=False)  # the highest id read
    seen: set[int] = field(default_factory=set)
    _stuck_since: float | None = None

    def __post_init__(self) -> None:
        self.high = self.watermark

    def missing(self, limit: int = 1000) -> list[int]:
        """Ids between ``watermark`` and ``high`` not read yet (at most ``limit``)."""
        out = []
        for i in range(self.watermark + 1, self.high):
            if i not in self.seen:
                out.append(i)
                if len(out) >= limit:
                    break
        return out

    def saw(self, event_id: int) -> None:
        if event_id <= self.watermark:
            return
        self.seen.add(event_id)
        self.high = max(self.high, event_id)
        while self.watermark + 1 in self.seen:
            self.seen.remove(self.watermark + 1)
            self.watermark += 1

    def settle(self, now: float) -> None:
        """Gives up on ids missing for longer than ``grace_seconds``."""
        if not self.seen:
            self._stuck_since = None
            return
        if self._stuck_since is None:
            self._stuck_since = now
            return
        if now - self._stuck_since >= self.grace_seconds:
            self.watermark = min(self.seen) - 1
            self._stuck_since = None
            self.saw(self.watermark + 1)


def last_event_id(session: Session) -> int:
    return int(session.scalar(select(func.max(JobEvent.id))) or 0)


def _feed_query() -> Any:
    return (select(JobEvent.id, JobEvent.job_id, JobEvent.at, JobEvent.kind, JobEvent.attempt,
                   JobEvent.detail, Job.owner_id, Job.batch_id)
            .join(Job, Job.id == JobEvent.job_id))


def events_after(session: Session, cursor: EventCursor, *, limit: int = 500) -> list[FeedEvent]:
    """Events after ``cursor.high`` (at most ``limit``) and the ones below it still missing, of
    every job, in id order; the caller filters them by owner (every id moves the cursor)."""
    rows = list(session.execute(_feed_query().where(JobEvent.id > cursor.high)
                                .order_by(JobEvent.id).limit(limit)))
    missing = cursor.missing()
    if missing:
        rows += session.execute(_feed_query().where(JobEvent.id.in_(missing)))
    return sorted((FeedEvent(*row) for row in rows), key=lambda e: e.id)


@dataclass(frozen=True, slots=True)
class Progress:
    job_id: str
    step: int
    total_steps: int
    batch_id: str | None


def running_progress(session: Session, user: User) -> list[Progress]:
    """The progress of every running job ``user`` may see."""
    query = select(Job.id, Job.progress_step, Job.progress_total, Job.num_inference_steps,
                   Job.batch_id).where(Job.state == JobState.RUNNING, Job.deleted_at.is_(None))
    if not user.is_admin:
        query = query.where(Job.owner_id == user.id)
    return [Progress(job_id, min(step, total or steps), total or steps, batch_id)
            for job_id, step, total, steps, batch_id in session.execute(query)]


def worker_groups(session: Session, known: Iterable[str] = ()) -> list[WorkerGroup]:
    """Every group that is not stopped, and the ``known`` ones whatever their state."""
    known = list(known)
    alive = WorkerGroup.state != "stopped"
    where = or_(alive, WorkerGroup.id.in_(known)) if known else alive
    rows = list(session.scalars(select(WorkerGroup).where(where)
                                .order_by(WorkerGroup.started_at)))
    for group in rows:
        session.expunge(group)
    return rows
