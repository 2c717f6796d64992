"""The worker's and the reaper's side of a job: claim, heartbeat, finish, fail, reap, expire, and
the user's cancel and delete.

Every state change is ONE conditional UPDATE whose WHERE names the state it expects (and, for a
running job, the attempt token of the attempt making the change), written together with its
`JobEvent` in one transaction and committed here. A write from an attempt that lost its lease
therefore matches no row and changes nothing; the caller sees ``None``/``False`` and must stop.
A claim, the hottest write of the worker side, is on PostgreSQL ONE statement (the UPDATE and
its event in a data-modifying ``WITH`` clause) run in autocommit: atomic on its own, and one
round trip instead of ``BEGIN``, the writes and ``COMMIT``.

Worker side, in order (all take ``now`` for tests; it defaults to the current UTC time):

- `claim_job(session, job_id, worker_group_id=..., rank=..., lease_seconds=...)` -> `Claim | None`
  queued -> running with a fresh attempt token and lease; None if someone else got it, it was
  cancelled, is not yet due (``not_before``), is past its deadline, or has used its attempts.
- `heartbeat(session, job_id, token, step=..., num_inference_steps=..., lease_seconds=...)`
  -> `Beat | None` renews the lease and records progress; ``Beat.cancel_requested`` tells the
  rank to stop after this step; None means the attempt is no longer current: drop the job
  without writing anything.
- `finish_succeeded(session, job_id, token, video_key=..., thumbnail_key=..., has_audio=...)`
  -> bool
- `finish_cancelled(session, job_id, token)` -> bool (after seeing ``cancel_requested``)
- `fail_job(session, job_id, token, error=..., retryable=False)` -> new state or None
- `note_resumed(session, job_id, token, step=...)`, `note_preempted(session, job_id, token,
  by_job=..., step=...)`, `note_continued(session, job_id, token, step=...)` -> bool: a running
  attempt that resumed from a checkpoint of an earlier attempt, was suspended in place on its
  replica for an interactive job, or went on after one; each writes its event (``resumed``,
  ``preempted``, ``continued``) and changes no state. False: the attempt is no longer current.
- `reap(session)` -> `Reaped`: expired leases back to queued (or dead after ``max_attempts``,
  or cancelled if a cancel was pending) and queued jobs past their deadline to expired. Run it
  periodically; put `Reaped.requeued` back in the Redis queue index
  (`scheduler.queue_index.add`).
- `expire(session, job_id)` -> the ids expired: the claim path ends a queued job it meets past
  its deadline, with the reason `reap` gives.

The user's side: `request_cancel` (a queued job at once, a running one at its rank's next step)
and `delete_job` (hides a finished job from its owner).
"""

from __future__ import annotations

import functools
import operator
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, bindparam, insert, literal, or_, select, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Session, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from storage.db import autocommit
from storage.queries import get_job
from storage.tables import TERMINAL_STATES, Job, JobEvent, JobState, User, utcnow

EXPIRED_ERROR = "its deadline passed before it could start"


class JobBusy(ValueError):
    """The job is running and the operation needs it queued or finished."""


@dataclass(frozen=True, slots=True)
class Claim:
    job: Job  # the row as claimed: the request fields to render
    attempt_token: str  # pass to every later call for this attempt
    lease_expires_at: datetime


def claim_job(
    session: Session,
    job_id: str,
    *,
    worker_group_id: str,
    rank: int | None = None,
    lease_seconds: float,
    now: datetime | None = None,
) -> Claim | None:
    """queued -> running for one attempt; None if the job is not claimable right now."""
    now = now or utcnow()
    token = secrets.token_hex(16)
    lease = now + timedelta(seconds=lease_seconds)
    params = {"claim_id": job_id, "claim_now": now, "claim_token": token, "claim_lease": lease,
              "claim_group": worker_group_id, "claim_rank": rank,
              "claim_detail": {"worker_group_id": worker_group_id, "rank": rank}}
    both, claim, add_event = _claim_statements()
    if session.get_bind().dialect.name == "postgresql":
        row = autocommit(session).execute(both, params).mappings().one_or_none()
        session.commit()  # no round trip: autocommit left no transaction open
    else:  # SQLite has no INSERT inside WITH
        row = session.execute(claim, params).mappings().one_or_none()
        if row is None:
            session.rollback()
            return None
        session.execute(add_event, {**params, "claim_attempt": row["attempts"]})
        session.commit()
    if row is None:
        return None
    return Claim(job=_as_loaded(session, row), attempt_token=token, lease_expires_at=lease)


@functools.cache
def _claim_statements() -> tuple[Any, Any, Any]:
    """(claim and its event in one statement for PostgreSQL, the claim alone, the event alone).

    Every worker group claims through this, at every step boundary where a rank frees up: one
    prebuilt statement with bound parameters (and on PostgreSQL one round trip for the UPDATE
    and its event) instead of building an ORM UPDATE and INSERT per call.
    """
    jobs_table = cast(Table, Job.__table__)  # declarative types it as any FROM clause
    events_table = cast(Table, JobEvent.__table__)
    now = bindparam("claim_now", type_=jobs_table.c.started_at.type)
    claim = (
        update(jobs_table)
        .where(jobs_table.c.id == bindparam("claim_id"),
               jobs_table.c.state == JobState.QUEUED.value,
               jobs_table.c.cancel_requested.is_(False),
               jobs_table.c.attempts - jobs_table.c.uncharged_attempts
               < jobs_table.c.max_attempts,
               or_(jobs_table.c.not_before.is_(None), jobs_table.c.not_before <= now),
               or_(jobs_table.c.deadline.is_(None), jobs_table.c.deadline > now))
        .values(state=JobState.RUNNING.value, attempts=jobs_table.c.attempts + 1,
                attempt_token=bindparam("claim_token"),
                lease_expires_at=bindparam("claim_lease", type_=jobs_table.c.started_at.type),
                worker_group_id=bindparam("claim_group"), rank=bindparam("claim_rank"),
                progress_step=0, progress_total=jobs_table.c.num_inference_steps, started_at=now,
                resumed_from_step=None)
        .returning(*jobs_table.c)
    )
    event = {"at": now, "kind": literal("claimed", type_=events_table.c.kind.type),
             "detail": bindparam("claim_detail", type_=events_table.c.detail.type)}
    claimed = claim.cte("claimed")
    add_claimed_event = insert(events_table).from_select(
        ["job_id", "attempt", *event], select(claimed.c.id, claimed.c.attempts, *event.values()))
    both = select(*claimed.c).add_cte(add_claimed_event.cte("claimed_event"))
    add_event = insert(events_table).values(
        job_id=bindparam("claim_id"), attempt=bindparam("claim_attempt"), **event)
    return both, claim, add_event


def _as_loaded(session: Session, row: Any) -> Job:
    """The session's ``Job`` for a row a Core statement returned, as if the ORM had loaded it."""
    job = Job()
    for attr in sa_inspect(Job).column_attrs:
        set_committed_value(job, attr.key, row[attr.columns[0].key])
    make_transient_to_detached(job)
    return session.merge(job, load=False)


@dataclass(frozen=True, slots=True)
class Beat:
    cancel_requested: bool  # stop after this step and call finish_cancelled
    lease_expires_at: datetime


def heartbeat(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    step: int | None = None,
    num_inference_steps: int | None = None,
    lease_seconds: float,
    now: datetime | None = None,
) -> Beat | None:
    """Renews the lease and records progress (no event: one per step would flood the table)."""
    now = now or utcnow()
    lease = now + timedelta(seconds=lease_seconds)
    values: dict[str, Any] = {"lease_expires_at": lease}
    if step is not None:
        values["progress_step"] = step
    if num_inference_steps is not None:
        # The step count of the progress report: column progress_total (the API's total_steps).
        values["progress_total"] = num_inference_steps
    job = _transition(session, job_id, attempt=attempt_token, event=None, now=now, **values)
    if job is None:
        return None
    return Beat(cancel_requested=job.cancel_requested, lease_expires_at=lease)


def note_resumed(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    step: int,
    now: datetime | None = None,
) -> bool:
    """This attempt resumed from a checkpoint of an earlier attempt's denoising state, at
    ``step``: records it on the job (``resumed_from_step``, which each claim clears) with a
    ``resumed`` event; commits. False (nothing written) if the attempt is no longer current."""
    step = _step(step)
    return _note_step(session, job_id, attempt_token, "resumed", step, now,
                      resumed_from_step=step)


def note_preempted(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    by_job: str,
    step: int,
    now: datetime | None = None,
) -> bool:
    """This attempt was suspended in place on its replica after ``step`` steps, for interactive
    job ``by_job``: counts it (``preemptions``) with a ``preempted`` event; commits. The job stays
    running (its lease must still be renewed). False (nothing written) if the attempt is no
    longer current."""
    return _note_step(session, job_id, attempt_token, "preempted", _step(step), now,
                      {"by_job": str(by_job)}, preemptions=Job.preemptions + 1)


def note_continued(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    step: int,
    now: datetime | None = None,
) -> bool:
    """This attempt, suspended by `note_preempted`, goes on at ``step``: a ``continued`` event;
    commits. False (nothing written) if the attempt is no longer current."""
    # A no-op assignment: the guarded UPDATE is what tells a current attempt from a stale one.
    return _note_step(session, job_id, attempt_token, "continued", _step(step), now,
                      attempt_token=attempt_token)


def _note_step(session: Session, job_id: str, token: str, kind: str, step: int,
               now: datetime | None, more: dict[str, Any] | None = None, /,
               **values: Any) -> bool:
    """One guarded UPDATE of a running attempt's row (``values``) with its ``kind`` event,
    whose detail is the step, the job's steps and ``more``; False if the attempt is not
    current."""
    job = _transition(
        session, job_id, attempt=token, event=kind,
        detail=lambda job: {"step": step, "total_steps": _total_steps(job), **(more or {})},
        now=now or utcnow(), **values,
    )
    return job is not None


def _step(step: int) -> int:
    """``step`` as a plain int (a numpy integer too: it goes into JSON); ValueError if negative
    or not whole."""
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if value < 0 or isinstance(step, bool):
        raise ValueError(f"step must be a whole number of steps, 0 or more, not {step!r}")
    return value


def _total_steps(job: Job) -> int:
    """The step count the job's progress is reported against (its API ``total_steps``)."""
    return job.progress_total or job.num_inference_steps


def finish_succeeded(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    video_key: str,
    thumbnail_key: str | None = None,
    has_audio: bool | None = None,
    gathers: int | None = None,
    blocks_computed: int | None = None,
    now: datetime | None = None,
) -> bool:
    """running -> succeeded; False (nothing written) if this attempt is no longer current.
    ``has_audio``: whether the stored video has a soundtrack (None: not said); ``gathers`` and
    ``blocks_computed``: what the attempt's steps cost (None: not said)."""
    now = now or utcnow()
    started = session.scalar(
        select(Job.started_at).where(Job.id == job_id, Job.attempt_token == attempt_token)
    )
    job = _transition(
        session, job_id, attempt=attempt_token, event="succeeded",
        detail=lambda job: {"render_seconds": job.render_seconds, "gathers": job.gathers,
                            "blocks_computed": job.blocks_computed}, now=now,
        state=JobState.SUCCEEDED.value, finished_at=now, lease_expires_at=None,
        progress_step=Job.progress_total, output_video_key=video_key,
        output_thumbnail_key=thumbnail_key, has_audio=has_audio, gathers=gathers,
        blocks_computed=blocks_computed,
        render_seconds=(now - started).total_seconds() if started is not None else None,
        error=None, error_code=None,
    )
    return job is not None


def finish_cancelled(
    session: Session, job_id: str, attempt_token: str, *, now: datetime | None = None
) -> bool:
    """running -> cancelled, once the rank has stopped after seeing ``cancel_requested``."""
    now = now or utcnow()
    job = _transition(
        session, job_id, Job.cancel_requested.is_(True), attempt=attempt_token,
        event="cancelled", detail=lambda job: {"at_step": job.progress_step}, now=now,
        state=JobState.CANCELLED.value, finished_at=now, lease_expires_at=None,
        error="cancelled by the user while rendering", error_code="cancelled",
    )
    return job is not None


def fail_job(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    error: str,
    code: str = "render_failed",
    retryable: bool = False,
    charged: bool = True,
    now: datetime | None = None,
) -> JobState | None:
    """Ends this attempt with an error. Not retryable -> failed. Retryable (the worker, not the
    request, was at fault) -> queued again while charged attempts remain, else dead.
    ``charged=False`` (retryable only: the job did not cause this end, e.g. its group stopped)
    hands the job back without spending an attempt: queued again whatever its attempts, or
    cancelled if a cancel is pending. Returns the new state, or None if the attempt is no longer
    current. A job back in `queued` must be re-added to the queue index by the caller.
    """
    now = now or utcnow()
    detail = {"error": error, "code": code, "charged": charged or not retryable}
    if retryable and not charged:
        if _transition(
            session, job_id, Job.cancel_requested.is_(False), attempt=attempt_token,
            event="requeued", detail=detail, now=now, keep_open=True,
            uncharged_attempts=Job.uncharged_attempts + 1, **_requeue_values(error, code),
        ) is not None:
            return JobState.QUEUED
        job = _transition(
            session, job_id, Job.cancel_requested.is_(True), attempt=attempt_token,
            event="cancelled", detail=detail, now=now, state=JobState.CANCELLED.value,
            finished_at=now, lease_expires_at=None, uncharged_attempts=Job.uncharged_attempts + 1,
            error="cancelled; its worker group stopped before the cancel took effect",
            error_code="cancelled",
        )
        return None if job is None else JobState.CANCELLED
    if retryable and _transition(
        session, job_id, Job.attempts - Job.uncharged_attempts < Job.max_attempts,
        Job.cancel_requested.is_(False), attempt=attempt_token, event="requeued", detail=detail,
        now=now, keep_open=True, **_requeue_values(error, code),
    ) is not None:
        return JobState.QUEUED
    new_state = JobState.DEAD if retryable else JobState.FAILED
    job = _transition(
        session, job_id, attempt=attempt_token, event=new_state.value, detail=detail, now=now,
        state=new_state.value, finished_at=now, lease_expires_at=None, error=error,
        error_code=code,
    )
    return None if job is None else new_state


def _requeue_values(error: str, code: str) -> dict[str, Any]:
    return dict(
        state=JobState.QUEUED.value, attempt_token=None, lease_expires_at=None,
        worker_group_id=None, rank=None, progress_step=0, started_at=None, error=error,
        error_code=code,
    )


@dataclass(slots=True)
class Reaped:
    requeued: list[Job] = field(default_factory=list)  # add these back to the queue index
    dead: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)


def reap(session: Session, *, now: datetime | None = None) -> Reaped:
    """Deals with running jobs whose lease ran out and queued jobs past their deadline; commits.

    Each UPDATE is guarded by the state and the lease time, so a worker that renews its lease
    concurrently keeps its job.
    """
    now = now or utcnow()
    out = Reaped()
    lapsed = (Job.state == JobState.RUNNING, Job.lease_expires_at < now)

    def bulk(*where: Any, **values: Any) -> list[Job]:
        return list(session.scalars(_update(*where, **values)))

    for job in bulk(*lapsed, Job.cancel_requested.is_(True),
                    state=JobState.CANCELLED.value, finished_at=now, lease_expires_at=None,
                    error="cancelled; its worker stopped reporting", error_code="cancelled"):
        out.cancelled.append(job.id)
        _event(session, job.id, "cancelled", now, job.attempts, reason="lease expired")
    lost = "its worker stopped reporting (lease expired)"
    for job in bulk(*lapsed, Job.attempts - Job.uncharged_attempts >= Job.max_attempts,
                    state=JobState.DEAD.value, finished_at=now, lease_expires_at=None,
                    error=f"gave up after its last allowed attempt: {lost}", error_code="dead"):
        out.dead.append(job.id)
        _event(session, job.id, "dead", now, job.attempts, reason="lease expired")
    for job in bulk(*lapsed, **_requeue_values(lost, "lease_expired")):
        out.requeued.append(job)
        _event(session, job.id, "requeued", now, job.attempts, reason="lease expired")
    out.expired = _expire(session, now)
    session.commit()
    return out


def expire(session: Session, job_id: str | None = None, *,
           now: datetime | None = None) -> list[str]:
    """queued -> expired, with its event, for job ``job_id`` (None: every queued job) once its
    deadline has passed, the moment `claim_job` stops taking it; commits. Returns the ids
    expired: empty (nothing written) if the job is not queued or not past its deadline."""
    now = now or utcnow()
    expired = _expire(session, now, *(() if job_id is None else (Job.id == job_id,)))
    if not expired:
        session.rollback()
        return []
    session.commit()
    return expired


def _expire(session: Session, now: datetime, *where: Any) -> list[str]:
    """The expiry of `expire` and `reap`, left uncommitted: the queued jobs where ``where`` holds
    and whose deadline is at or before ``now`` become ``expired`` with their events."""
    expired = []
    for job in session.scalars(_update(
        Job.state == JobState.QUEUED, Job.deadline <= now, *where,
        state=JobState.EXPIRED.value, finished_at=now, error=EXPIRED_ERROR, error_code="expired",
    )):
        expired.append(job.id)
        _event(session, job.id, "expired", now, job.attempts)
    return expired


def request_cancel(
    session: Session, job_id: str, user: User, *, now: datetime | None = None
) -> tuple[Job, bool] | None:
    """Cancels a queued job at once, or flags a running one for its rank to stop after the
    current step. Returns (job, was_queued) -- remove a was-queued job from the queue index --
    or None if ``user`` cannot see the job. A finished job is returned unchanged.
    """
    job = get_job(session, job_id, user)
    if job is None:
        return None
    now = now or utcnow()
    done = _transition(
        session, job_id, Job.state == JobState.QUEUED,
        event="cancelled", detail={"by": user.name}, now=now, keep_open=True,
        state=JobState.CANCELLED.value, cancel_requested=True, finished_at=now,
        error="cancelled by the user before it started", error_code="cancelled",
    )
    if done is not None:
        return done, True
    flagged = _transition(
        session, job_id, Job.state == JobState.RUNNING, Job.cancel_requested.is_(False),
        event="cancel_requested", detail={"by": user.name}, now=now, cancel_requested=True,
    )
    if flagged is not None:
        return flagged, False
    session.refresh(job)
    return job, False


def delete_job(
    session: Session, job_id: str, user: User, *, now: datetime | None = None
) -> tuple[Job, bool] | None:
    """Hides a finished (or still queued: it is cancelled first) job from its owner for good.

    Returns (job, was_queued) or None if not visible; raises `JobBusy` for a running job. The
    caller deletes the job's outputs from the store after this commits.
    """
    now = now or utcnow()
    cancelled = request_cancel(session, job_id, user, now=now)
    if cancelled is None:
        return None
    job, was_queued = cancelled
    if job.state not in TERMINAL_STATES:
        raise JobBusy("the job is running; it can be deleted once its cancel takes effect")
    deleted = _transition(
        session, job_id, Job.deleted_at.is_(None),
        Job.state.in_([s.value for s in TERMINAL_STATES]),
        event="deleted", detail={"by": user.name}, now=now, deleted_at=now,
    )
    if deleted is None:
        return None
    return deleted, was_queued


def _transition(
    session: Session,
    job_id: str,
    *where: Any,
    attempt: str | None = None,
    event: str | None,
    detail: dict[str, Any] | Callable[[Job], dict[str, Any]] | None = None,
    now: datetime,
    keep_open: bool = False,
    **values: Any,
) -> Job | None:
    """ONE conditional UPDATE of job ``job_id`` to ``values``, guarded by ``where`` (and, given
    an ``attempt`` token, by the job running that attempt), and its ``event`` with ``detail``
    (or ``detail(row)`` of the updated row; no event if None), committed together.

    Returns the updated row, or None if the guard matched no row: nothing was written, and the
    transaction is rolled back (left open with ``keep_open``, for a fallback change)."""
    if attempt is not None:
        where = (Job.state == JobState.RUNNING, Job.attempt_token == attempt, *where)
    job = session.scalars(_update(Job.id == job_id, *where, **values)).one_or_none()
    if job is None:
        if not keep_open:
            session.rollback()
        return None
    if event is not None:
        if callable(detail):
            detail = detail(job)
        _event(session, job_id, event, now, job.attempts, **(detail or {}))
    session.commit()
    return job


def _update(*where: Any, **values: Any) -> Any:
    """The conditional UPDATE of the jobs where ``where`` holds, returning the updated rows."""
    return (
        update(Job)
        .where(*where)
        .values(**values)
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    )


def _event(session: Session, job_id: str, kind: str, now: datetime, attempt: int = 0,
           **detail: Any) -> None:
    session.execute(
        insert(JobEvent).values(job_id=job_id, at=now, kind=kind, attempt=attempt, detail=detail)
    )
