"""Aggregate queries for /metrics: computed from the database at scrape time, so every API
replica reports the same numbers whichever process did the work."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from storage.tables import Job, JobState, utcnow

RENDER_SECONDS_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def jobs_by_state(session: Session, owner_id: int | None = None) -> dict[str, int]:
    """Jobs per state; one owner's only when ``owner_id`` is given."""
    query = select(Job.state, func.count()).group_by(Job.state)
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    return {state: int(n) for state, n in session.execute(query)}


def queue_depth(session: Session) -> dict[tuple[str, int], int]:
    """Queued jobs per (class, priority)."""
    rows = session.execute(
        select(Job.class_, Job.priority, func.count())
        .where(Job.state == JobState.QUEUED)
        .group_by(Job.class_, Job.priority)
    )
    return {(c, int(p)): int(n) for c, p, n in rows}


def render_seconds_histogram(session: Session) -> tuple[list[int], int, float]:
    """Cumulative bucket counts (one per `RENDER_SECONDS_BUCKETS` bound), total count and sum
    over every succeeded job -- one aggregate query."""
    done = Job.render_seconds.is_not(None)
    columns = [
        func.sum(case((Job.render_seconds <= bound, 1), else_=0))
        for bound in RENDER_SECONDS_BUCKETS
    ]
    row = session.execute(
        select(*columns, func.count(), func.coalesce(func.sum(Job.render_seconds), 0.0))
        .where(Job.state == JobState.SUCCEEDED, done)
    ).one()
    buckets = [int(v or 0) for v in row[:-2]]
    return buckets, int(row[-2] or 0), float(row[-1] or 0.0)


def videos_finished_since(session: Session, since: datetime, owner_id: int | None = None) -> int:
    query = (select(func.count()).select_from(Job)
             .where(Job.state == JobState.SUCCEEDED, Job.finished_at >= since))
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    return int(session.scalar(query) or 0)


def videos_last_hour(session: Session, now: datetime | None = None) -> int:
    return videos_finished_since(session, (now or utcnow()) - timedelta(hours=1))


def jobs_by_class_and_state(session: Session,
                            owner_id: int | None = None) -> dict[str, dict[str, int]]:
    """Jobs per class, then per state; one owner's only when ``owner_id`` is given."""
    query = select(Job.class_, Job.state, func.count()).group_by(Job.class_, Job.state)
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    out: dict[str, dict[str, int]] = {}
    for job_class, state, n in session.execute(query):
        out.setdefault(job_class, {})[state] = int(n)
    return out


def throughput_since(session: Session, since: datetime, now: datetime,
                     owner_id: int | None = None) -> tuple[int, float | None]:
    """(videos finished since ``since``, videos per hour over that span): the span starts when
    the first of them started, if later than ``since``, so a service up for ten minutes is not
    read as a slow hour. None when nothing finished."""
    query = (select(func.count(), func.min(Job.started_at))
             .where(Job.state == JobState.SUCCEEDED, Job.finished_at >= since))
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    count, first_start = session.execute(query).one()
    count = int(count or 0)
    if not count:
        return 0, None
    start = max(since, first_start) if first_start is not None else since
    hours = max((now - start).total_seconds(), 60.0) / 3600  # a minute at least
    return count, count / hours


def recent_failures(session: Session, since: datetime, owner_id: int | None = None,
                    limit: int = 10) -> tuple[int, list[Job]]:
    """(how many jobs failed, went dead or expired since ``since``, the newest ``limit``)."""
    bad = (JobState.FAILED, JobState.DEAD, JobState.EXPIRED)
    where = [Job.state.in_([s.value for s in bad]), Job.finished_at >= since]
    if owner_id is not None:
        where.append(Job.owner_id == owner_id)
    total = int(session.scalar(select(func.count()).select_from(Job).where(*where)) or 0)
    rows = list(session.scalars(select(Job).where(*where)
                                .order_by(Job.finished_at.desc()).limit(limit)))
    return total, rows

