"""The batch repository: submit many jobs as one batch, read its progress and report, cancel it.

The morning report (`report`) is plain data built here, below the API, so that the webhook worker
sends the same figures as `GET /v1/batches/{id}/report` without loading the web layer.

A batch is created with all its jobs in ONE transaction (every job or none), committed here; tell
Redis (`scheduler.queue_index.add`) about the returned jobs only after that. Cancelling is
set-based but guarded exactly like `storage.lifecycle.request_cancel`: queued jobs become
``cancelled`` at once, running ones get ``cancel_requested`` for their rank to see at its next
step; finished jobs are untouched. Every change writes its `JobEvent`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import and_, func, insert, or_, select, true, update
from sqlalchemy.orm import Session

from storage.idempotency import create_or_replay
from storage.pagination import decode_cursor, encode_cursor
from storage.submission import JobSpec, check_queue_room, is_job_id, new_job_id, new_job_row
from storage.tables import TERMINAL_STATES, Batch, Job, JobEvent, JobState, User, utcnow

_TERMINAL = [s.value for s in TERMINAL_STATES]


@dataclass(frozen=True, slots=True)
class BatchCreated:
    batch: Batch
    jobs: list[Job]  # the new jobs, in line order; empty for a replay (nothing to dispatch)
    created: bool  # False: an idempotent replay returned the batch made earlier


def create_batch(
    session: Session,
    owner: User,
    specs: Sequence[JobSpec],
    *,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
    not_before: datetime | None = None,
    deadline: datetime | None = None,
    webhook_url: str | None = None,
    webhook_events: list[str] | None = None,
    request_hash: str,
    idempotency_key: str | None = None,
    max_attempts: int = 3,
    max_queued: int | None = None,
    now: datetime | None = None,
) -> BatchCreated:
    """Stores the batch and one queued job per spec in one transaction and commits. A spec
    without a ``batch_index`` (its line in the submission) gets its 1-based position.

    Raises `storage.idempotency.IdempotencyConflict` when the key was used with another request
    and `storage.submission.QueueFull` when the owner's queued jobs plus these would pass
    ``max_queued`` (an idempotent replay is never refused).
    """
    if not specs:
        raise ValueError("a batch needs at least one job")
    now = now or utcnow()

    def insert_batch() -> BatchCreated:
        if max_queued is not None:
            check_queue_room(session, owner.id, max_queued, adding=len(specs))
        batch = Batch(id=new_job_id(), owner_id=owner.id, name=name, created_at=now,
                      meta=dict(metadata or {}), not_before=not_before, deadline=deadline,
                      webhook_url=webhook_url, webhook_events=webhook_events,
                      idempotency_key=idempotency_key, request_hash=request_hash)
        session.add(batch)
        session.flush()  # the jobs' foreign key needs the batch row first
        rows = [
            new_job_row(owner.id,
                        replace(spec, batch_id=batch.id, batch_index=spec.batch_index or i),
                        request_hash=request_hash, idempotency_key=None,
                        max_attempts=max_attempts, now=now)
            for i, spec in enumerate(specs, start=1)
        ]
        session.add_all(rows)
        session.flush()
        session.execute(insert(JobEvent), [
            {"job_id": job.id, "at": now, "kind": "created", "attempt": 0,
             "detail": {"batch_id": batch.id}} for job in rows
        ])
        session.commit()
        return BatchCreated(batch=batch, jobs=rows, created=True)

    return create_or_replay(
        session, Batch, owner.id, idempotency_key, request_hash, create=insert_batch,
        replay=lambda batch: BatchCreated(batch=batch, jobs=[], created=False),
    )


def _visible(user: User) -> Any:
    return true() if user.is_admin else Batch.owner_id == user.id


def get_batch(session: Session, batch_id: str, user: User) -> Batch | None:
    """The batch if ``user`` may see it (their own, or any for an admin); else None."""
    if not is_job_id(batch_id):
        return None
    return session.scalar(select(Batch).where(Batch.id == batch_id, _visible(user)))


def list_batches(
    session: Session, user: User, *, owner_id: int | None = None, limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[Batch], str | None]:
    """A page of the batches ``user`` may see, newest first, and the cursor for the next page
    (None at the end). Raises ValueError for a cursor this API did not make."""
    query = select(Batch).where(_visible(user))
    if owner_id is not None:
        query = query.where(Batch.owner_id == owner_id)
    if cursor is not None:
        created, batch_id = decode_cursor(cursor)
        query = query.where(or_(Batch.created_at < created,
                                and_(Batch.created_at == created, Batch.id < batch_id)))
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    if len(rows) > limit:
        return rows[:limit], encode_cursor(rows[limit - 1])
    return rows, None


@dataclass(slots=True)
class Summary:
    """Where one batch stands, from its job rows."""

    counts: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in JobState})
    # Mean over jobs of the share of their steps done; a finished job counts as whole.
    step_fraction: float = 0.0
    started_at: datetime | None = None  # earliest start among its jobs
    last_finished_at: datetime | None = None  # latest finish of a job that ran
    finished_at: datetime | None = None  # when its last job ended; None while any is left
    # Jobs that ran (were started) and have ended: what throughput is measured on.
    num_ran_finished: int = 0
    total_render_seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def num_finished(self) -> int:
        return sum(self.counts[s] for s in _TERMINAL)

    @property
    def num_left(self) -> int:
        return self.counts[JobState.QUEUED] + self.counts[JobState.RUNNING]

    def eta_seconds(self, now: datetime) -> float | None:
        """Seconds until the last job ends at the pace measured so far (jobs ended per second
        since the first one started); None until one has ended, or when none are left."""
        if not self.num_left or not self.num_ran_finished or self.started_at is None:
            return None
        elapsed = (now - self.started_at).total_seconds()
        if elapsed <= 0:
            return None
        return self.num_left / (self.num_ran_finished / elapsed)


def summaries(session: Session, batch_ids: Sequence[str]) -> dict[str, Summary]:
    """A `Summary` per batch id, in two queries whatever the number of batches or jobs."""
    out = {batch_id: Summary() for batch_id in batch_ids}
    if not out:
        return out
    ran = Job.started_at.is_not(None)
    rows = session.execute(
        select(Job.batch_id, Job.state, func.count(), func.min(Job.started_at),
               func.max(Job.finished_at), func.count(Job.started_at),
               func.coalesce(func.sum(Job.render_seconds), 0.0))
        .where(Job.batch_id.in_(list(out)))
        .group_by(Job.batch_id, Job.state)
    )
    for batch_id, state, count, started, finished, num_ran, render_seconds in rows:
        s = out[cast(str, batch_id)]  # one of batch_ids: the WHERE
        s.counts[state] = int(count)
        s.total_render_seconds += float(cast(float, render_seconds))  # coalesced to 0.0
        if started is not None and (s.started_at is None or started < s.started_at):
            s.started_at = started
        if state in _TERMINAL:
            s.num_ran_finished += int(num_ran)
            if finished is not None and num_ran and (
                    s.last_finished_at is None or finished > s.last_finished_at):
                s.last_finished_at = finished
            if finished is not None and (s.finished_at is None or finished > s.finished_at):
                s.finished_at = finished
    # Step progress of running jobs: there are at most as many as ranks serving the batch.
    running = session.execute(
        select(Job.batch_id, Job.progress_step, Job.progress_total)
        .where(Job.batch_id.in_(list(out)), Job.state == JobState.RUNNING, ran)
    )
    partial: dict[str, float] = {}
    for batch_id, step, total in running:
        batch_id = cast(str, batch_id)  # one of batch_ids: the WHERE
        partial[batch_id] = partial.get(batch_id, 0.0) + (min(step, total) / total if total
                                                          else 0.0)
    for batch_id, s in out.items():
        if s.num_left:
            s.finished_at = None
        if s.total:
            s.step_fraction = (s.num_finished + partial.get(batch_id, 0.0)) / s.total
    return out


def batch_jobs(session: Session, batch_id: str) -> list[Job]:
    """Every job of the batch, in the order of its submission's lines."""
    return list(session.scalars(select(Job).where(Job.batch_id == batch_id)
                                .order_by(Job.batch_index, Job.created_at, Job.id)))


@dataclass(frozen=True, slots=True)
class ReportError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ReportJob:
    """One job in a batch's report; the fields of the API's ``BatchReportJob``."""

    id: str
    line: int | None  # 1-based line (or position) in the submission
    status: str
    prompt: str
    seed: int
    started_at: datetime | None
    finished_at: datetime | None
    render_seconds: float | None
    video_url: str | None
    thumbnail_url: str | None
    error: ReportError | None


@dataclass(frozen=True, slots=True)
class Report:
    """A batch's morning report; the fields of the API's ``BatchReport`` (less its ``object``),
    in the same order, so a JSON dump of either reads the same."""

    id: str
    name: str | None
    num_jobs: int
    counts: dict[str, int]
    not_before: datetime | None
    deadline: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    active_seconds: float | None  # first job's start to the last finish of a job that ran
    videos_per_hour: float | None  # succeeded jobs per hour of active_seconds
    total_render_seconds: float
    problems: list[ReportJob]  # the failed, expired and dead jobs
    jobs: list[ReportJob]


_PROBLEM_STATES = frozenset({JobState.FAILED, JobState.EXPIRED, JobState.DEAD})


def video_url(job: Job) -> str | None:
    """Where a succeeded job's video is served; None until there is one."""
    done = job.state == JobState.SUCCEEDED and job.output_video_key
    return f"/v1/jobs/{job.id}/video" if done else None


def thumbnail_url(job: Job) -> str | None:
    done = job.state == JobState.SUCCEEDED and job.output_thumbnail_key
    return f"/v1/jobs/{job.id}/thumbnail" if done else None


def job_error(job: Job) -> ReportError | None:
    """The error a finished, unsuccessful job shows; None for one that is queued, running or
    succeeded (a retried job's earlier error is not its outcome)."""
    if job.error is None or job.state in (JobState.QUEUED, JobState.RUNNING,
                                          JobState.SUCCEEDED):
        return None
    return ReportError(code=job.error_code or job.state, message=job.error)


def report(session: Session, batch: Batch) -> Report:
    """The batch's morning report: counts, throughput, render time, every job and its problems."""
    summary = summaries(session, [batch.id])[batch.id]
    rows = [_report_job(job) for job in batch_jobs(session, batch.id)]
    active = None
    if summary.started_at is not None and summary.last_finished_at is not None:
        active = max(0.0, (summary.last_finished_at - summary.started_at).total_seconds())
    per_hour = None
    if active:
        per_hour = round(summary.counts[JobState.SUCCEEDED] / (active / 3600), 2)
    return Report(
        id=batch.id, name=batch.name, num_jobs=summary.total, counts=summary.counts,
        not_before=batch.not_before, deadline=batch.deadline, created_at=batch.created_at,
        started_at=summary.started_at, finished_at=summary.finished_at,
        active_seconds=round(active, 3) if active is not None else None,
        videos_per_hour=per_hour,
        total_render_seconds=round(summary.total_render_seconds, 3),
        problems=[r for r in rows if r.status in _PROBLEM_STATES], jobs=rows,
    )


def _report_job(job: Job) -> ReportJob:
    return ReportJob(
        id=job.id, line=job.batch_index, status=job.state, prompt=job.prompt, seed=job.seed,
        started_at=job.started_at, finished_at=job.finished_at,
        render_seconds=job.render_seconds, video_url=video_url(job),
        thumbnail_url=thumbnail_url(job), error=job_error(job),
    )


@dataclass(frozen=True, slots=True)
class Cancelled:
    cancelled: list[Job]  # were queued, now cancelled: remove them from the queue index
    num_requested: int  # running jobs flagged to stop after their current step


def cancel_batch(session: Session, batch: Batch, user: User, *,
                 now: datetime | None = None) -> Cancelled:
    """Cancels every queued job of the batch at once and asks the running ones to stop, with
    the guards of `storage.lifecycle.request_cancel`; commits."""
    now = now or utcnow()
    cancelled = list(session.scalars(
        update(Job)
        .where(Job.batch_id == batch.id, Job.state == JobState.QUEUED)
        .values(state=JobState.CANCELLED.value, cancel_requested=True, finished_at=now,
                error="cancelled by the user before it started", error_code="cancelled")
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    ))
    flagged = session.execute(
        update(Job)
        .where(Job.batch_id == batch.id, Job.state == JobState.RUNNING,
               Job.cancel_requested.is_(False))
        .values(cancel_requested=True)
        .returning(Job.id, Job.attempts)
        .execution_options(synchronize_session=False)
    ).all()
    events = [{"job_id": job.id, "at": now, "kind": "cancelled", "attempt": job.attempts,
               "detail": {"by": user.name, "batch_id": batch.id}} for job in cancelled]
    events += [{"job_id": job_id, "at": now, "kind": "cancel_requested", "attempt": attempts,
                "detail": {"by": user.name, "batch_id": batch.id}}
               for job_id, attempts in flagged]
    if events:
        session.execute(insert(JobEvent), events)
    session.commit()
    return Cancelled(cancelled=cancelled, num_requested=len(flagged))
