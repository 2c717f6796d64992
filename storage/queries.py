"""Reading jobs: one job, a page of jobs, a queued job's position, a job's events and the jobs
each worker group runs (the API's and the dashboard's reader). A user sees their own jobs that
are not deleted; an admin sees every job that is not deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.orm import Session

from storage.pagination import decode_cursor, encode_cursor
from storage.submission import is_job_id
from storage.tables import Job, JobClass, JobEvent, JobState, User

# Ordering of classes for queue position: interactive work always goes first.
_CLASS_RANK = {JobClass.INTERACTIVE.value: 0, JobClass.BATCH.value: 1}


def _visible(user: User) -> Any:
    cond = Job.deleted_at.is_(None)
    return cond if user.is_admin else and_(cond, Job.owner_id == user.id)


def get_job(session: Session, job_id: str, user: User) -> Job | None:
    """The job if ``user`` may see it (their own, or any for an admin); else None."""
    if not is_job_id(job_id):
        return None
    return session.scalar(select(Job).where(Job.id == job_id, _visible(user)))


def queue_position(session: Session, job: Job) -> int | None:
    """How many queued jobs come before this one in priority order (0 = next); None if not queued.

    Interactive before batch, then higher priority, then older first. The batcher may still
    reorder within that (fairness between users, model compatibility), so this is an estimate.
    """
    if job.state != JobState.QUEUED:
        return None
    class_rank = case(_CLASS_RANK, value=Job.class_)
    mine = _CLASS_RANK[job.class_]
    ahead = or_(
        class_rank < mine,
        and_(
            class_rank == mine,
            or_(
                Job.priority > job.priority,
                and_(
                    Job.priority == job.priority,
                    or_(
                        Job.created_at < job.created_at,
                        and_(Job.created_at == job.created_at, Job.id < job.id),
                    ),
                ),
            ),
        ),
    )
    count = session.scalar(
        select(func.count()).select_from(Job).where(Job.state == JobState.QUEUED, ahead)
    )
    return int(count or 0)


def list_jobs(
    session: Session,
    user: User,
    *,
    states: Sequence[str] = (),
    model: str | None = None,
    job_class: str | None = None,
    batch_id: str | None = None,
    owner_id: int | None = None,
    limit: int = 50,
    cursor: str | None = None,
    newest_first: bool = True,
) -> tuple[list[Job], str | None]:
    """A page of the jobs ``user`` may see and the cursor for the next page (None at the end).

    Keyset pagination on (created_at, id): pages stay stable while new jobs arrive.
    """
    query = select(Job).where(_visible(user))
    if states:
        query = query.where(Job.state.in_(list(states)))
    if model is not None:
        query = query.where(Job.model == model)
    if job_class is not None:
        query = query.where(Job.class_ == job_class)
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    if cursor is not None:
        created, job_id = decode_cursor(cursor)
        if newest_first:
            query = query.where(
                or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id))
            )
        else:
            query = query.where(
                or_(Job.created_at > created, and_(Job.created_at == created, Job.id > job_id))
            )
    order = (
        (Job.created_at.desc(), Job.id.desc()) if newest_first else (Job.created_at, Job.id)
    )
    rows = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    if len(rows) > limit:
        return rows[:limit], encode_cursor(rows[limit - 1])
    return rows, None


def job_events(session: Session, job_id: str) -> list[JobEvent]:
    return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id)
                                .order_by(JobEvent.id)))


def running_jobs_by_group(session: Session, group_ids: Sequence[str]) -> dict[str, list[Job]]:
    if not group_ids:
        return {}
    rows = session.scalars(select(Job).where(Job.state == JobState.RUNNING,
                                             Job.worker_group_id.in_(list(group_ids))))
    out: dict[str, list[Job]] = {}
    for job in rows:
        out.setdefault(job.worker_group_id or "", []).append(job)
    return out


def unfinished_job_ids(session: Session, job_ids: Sequence[str]) -> set[str]:
    """Those of ``job_ids`` whose job is still there and not over (queued or running)."""
    if not job_ids:
        return set()
    rows = session.scalars(select(Job.id).where(Job.id.in_(list(job_ids)),
                                                Job.state.in_([JobState.QUEUED,
                                                               JobState.RUNNING])))
    return set(rows)
