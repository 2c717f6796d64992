"""Webhook delivery records: which finished jobs still owe their webhook, and one attempt at a time.

The outbox is the ``jobs`` table itself: a job in a final state with a ``webhook_url`` owes one
delivery until its `WebhookDelivery` row says ``delivered`` or ``failed`` (gave up). Nothing has to
be written when the job finishes, so no process can die between "finished" and "webhook owed".

An attempt is taken like a lease: `begin_attempt` is one conditional UPDATE that moves
``next_attempt_at`` past the attempt's end, so two tasks for the same job (the one enqueued at
finish and the sweeper's) never post at once, and an attempt whose process died becomes due again
once its hold runs out. Receivers must still tolerate a repeat (a process may die after the POST
and before `record_result`): the ``Kiln-Delivery`` header carries the job id for that.

The outbox is also the only record of a retry: a failed attempt that is to be tried again sets
``next_attempt_at`` to the retry's time and its task ends; the periodic sweeper finds the row
once that time has come (`owed`) and asks for the next attempt.

A batch's one event, batch.completed, has its outbox on the batch row (`complete_batch` and
below); a job.started or job.progress event that is to be tried again gets a row of its own
until it is delivered or given up (`hold_live_retry` and below); and every attempt at any event
goes into the delivery log (`log_attempt`, `delivery_log`), which the job page shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, get_args

from sqlalchemy import ColumnElement, and_, delete, exists, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.tables import (
    TERMINAL_STATES,
    Batch,
    Job,
    LiveWebhookRetry,
    WebhookAttempt,
    WebhookDelivery,
    utcnow,
)

# The events a job's webhook may ask for (``Job.webhook_events``). The final ones are
# ``job.<final state>`` and go through the outbox below; job.started and job.progress are sent
# by the worker group as they happen, best effort (one whose task is lost is not sent again; one
# whose attempt failed is retried through `LiveWebhookRetry`).
WebhookEvent = Literal["job.started", "job.progress", "job.succeeded", "job.failed",
                       "job.cancelled", "job.dead", "job.expired"]
EVENTS: tuple[str, ...] = get_args(WebhookEvent)
FINAL_EVENTS = frozenset(f"job.{s.value}" for s in TERMINAL_STATES)
LIVE_EVENTS = frozenset({"job.started", "job.progress"})


# A batch's webhook has one event, sent once its last job has ended.
BatchWebhookEvent = Literal["batch.completed"]
BATCH_COMPLETED = "batch.completed"


def wants(events: Iterable[str] | None, event: str) -> bool:
    """Whether a job or batch that asked for ``events`` (None: a job's final ones, a batch's
    batch.completed) gets ``event``."""
    if events is None:
        return event in FINAL_EVENTS or event == BATCH_COMPLETED
    return event in events


PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"  # gave up: out of attempts, the receiver answered 410 Gone, or a refused address
UNWANTED = "unwanted"  # the job did not ask for its final event: nothing was sent
_FINAL = (DELIVERED, FAILED, UNWANTED)
_TERMINAL = [s.value for s in TERMINAL_STATES]


@dataclass(frozen=True, slots=True)
class Attempt:
    job: Job  # the finished job, as read when the attempt began
    number: int  # 1 for the first attempt


def owed(session: Session, *, since: datetime, now: datetime | None = None,
         first_by: datetime | None = None, limit: int = 500) -> list[str]:
    """Ids of jobs finished between ``since`` and ``now`` whose webhook is neither delivered nor
    given up, and due at ``now``: its retry (or a died attempt's hold) is due, or it was never
    attempted and the job finished by ``first_by`` (default ``now``; a later one's first attempt
    is left to the task enqueued when it finished)."""
    now = now or utcnow()
    first_by = first_by or now
    settled_or_waiting = exists().where(
        WebhookDelivery.job_id == Job.id,
        or_(WebhookDelivery.state.in_(_FINAL), WebhookDelivery.next_attempt_at > now),
    )
    attempted = exists().where(WebhookDelivery.job_id == Job.id, WebhookDelivery.attempts > 0)
    stmt = (
        select(Job.id)
        .where(Job.finished_at >= since, Job.finished_at <= now, Job.state.in_(_TERMINAL),
               Job.webhook_url.is_not(None), ~settled_or_waiting,
               or_(attempted, Job.finished_at <= first_by))
        .order_by(Job.finished_at)
        .limit(limit)
    )
    ids = list(session.scalars(stmt))
    session.rollback()  # end the read transaction
    return ids


def begin_attempt(session: Session, job_id: str, *, hold_seconds: float,
                  now: datetime | None = None) -> Attempt | None:
    """Takes the next attempt at this job's webhook and commits; None when there is nothing to do
    now: no such finished job with a webhook_url, already settled, or an attempt is due later or
    still running elsewhere. The caller posts, then calls `record_result` with ``number``."""
    now = now or utcnow()
    job = session.scalar(select(Job).where(Job.id == job_id, Job.state.in_(_TERMINAL),
                                           Job.webhook_url.is_not(None)))
    if job is None:
        session.rollback()
        return None
    if session.get(WebhookDelivery, job_id) is None:
        try:
            session.execute(insert(WebhookDelivery).values(
                job_id=job_id, state=PENDING, attempts=0, next_attempt_at=now, created_at=now))
            session.commit()
        except IntegrityError:
            session.rollback()  # a concurrent attempt made the row first; the UPDATE decides
    number = _guarded(
        session, update(WebhookDelivery)
        .where(WebhookDelivery.job_id == job_id, WebhookDelivery.state == PENDING,
               WebhookDelivery.next_attempt_at <= now)
        .values(attempts=WebhookDelivery.attempts + 1,
                next_attempt_at=now + timedelta(seconds=hold_seconds))
        .returning(WebhookDelivery.attempts))
    return None if number is None else Attempt(job=job, number=int(number))


def _guarded(session: Session, change: Any) -> Any:
    """Runs ``change``, an UPDATE guarded by the outbox state it expects and RETURNING one
    column, and commits: that column's new value, or None (rolled back) when the guard let
    nothing through. So at most one caller takes each attempt or settles it."""
    row = session.execute(change).one_or_none()
    if row is None:
        session.rollback()
        return None
    session.commit()
    return row[0]


def record_result(session: Session, job_id: str, number: int, *, delivered: bool,
                  status: int | None = None, error: str | None = None,
                  retry_at: datetime | None = None, now: datetime | None = None) -> str | None:
    """Records how attempt ``number`` went and commits: ``delivered``; else ``pending`` again
    from ``retry_at``, or ``failed`` (given up) when ``retry_at`` is None. Returns the new state,
    or None if a later attempt has taken over (this one overran its hold) and nothing was
    written."""
    now = now or utcnow()
    if delivered:
        values: dict[str, object] = dict(state=DELIVERED, finished_at=now, last_error=None)
    elif retry_at is not None:
        values = dict(state=PENDING, next_attempt_at=retry_at, last_error=error)
    else:
        values = dict(state=FAILED, finished_at=now, last_error=error)
    state = _guarded(
        session, update(WebhookDelivery)
        .where(WebhookDelivery.job_id == job_id, WebhookDelivery.state == PENDING,
               WebhookDelivery.attempts == number)
        .values(last_status=status, **values)
        .returning(WebhookDelivery.state))
    return None if state is None else str(state)


def settle_unwanted(session: Session, job_id: str, number: int, *,
                    now: datetime | None = None) -> None:
    """Settles attempt ``number`` as `UNWANTED` (the job's filter leaves its final event out) and
    commits: the job owes nothing any more."""
    now = now or utcnow()
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.job_id == job_id, WebhookDelivery.state == PENDING,
               WebhookDelivery.attempts == number)
        .values(state=UNWANTED, finished_at=now, last_status=None, last_error=None))
    session.commit()


def delivery(session: Session, job_id: str) -> WebhookDelivery | None:
    return session.get(WebhookDelivery, job_id)


def has_webhook(session: Session, job_ids: list[str]) -> list[str]:
    """Those of ``job_ids`` that are finished and have a webhook_url (what to enqueue)."""
    if not job_ids:
        return []
    return list(session.scalars(select(Job.id).where(
        and_(Job.id.in_(job_ids), Job.state.in_(_TERMINAL), Job.webhook_url.is_not(None)))))


# ---- batch.completed: the batch row is the outbox -------------------------------------------
#
# Whether a batch is complete is decided once, by a guarded UPDATE that moves ``webhook_state``
# from NULL to pending only while no job of the batch is unfinished. It runs after the jobs'
# own commits (never in the transaction that ends a job: two jobs ending at once would each see
# the other still running), so of the callers that race for it, PostgreSQL's row lock lets one
# through and re-checks the others' condition against its write. Attempts are then leased on the
# batch row exactly as `begin_attempt` leases a job's.

def _all_jobs_ended(ended_by: datetime | None = None) -> Any:
    """No job of the batch is unfinished (or, with ``ended_by``, ended after it)."""
    left: ColumnElement[bool] = Job.state.not_in(_TERMINAL)
    if ended_by is not None:
        left = or_(left, Job.finished_at > ended_by)
    return ~exists().where(Job.batch_id == Batch.id, left)


def complete_batch(session: Session, batch_id: str, *, now: datetime | None = None) -> bool:
    """Makes the batch's batch.completed owed if it has a webhook and every job of it has ended;
    commits. True for the one call that did it."""
    now = now or utcnow()
    done = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.webhook_url.is_not(None),
               Batch.webhook_state.is_(None), _all_jobs_ended())
        .values(webhook_state=PENDING, webhook_next_attempt_at=now)
        .returning(Batch.id)
    ).one_or_none()
    session.commit()
    return done is not None


def completed_batches(session: Session, job_ids: list[str]) -> list[str]:
    """The batches of ``job_ids`` whose batch.completed is due to be decided: a webhook, not yet
    owed, every job ended (what to enqueue after those jobs ended)."""
    if not job_ids:
        return []
    of_jobs = select(Job.batch_id).where(Job.id.in_(job_ids), Job.batch_id.is_not(None))
    return list(session.scalars(select(Batch.id).where(
        Batch.id.in_(of_jobs), Batch.webhook_url.is_not(None), Batch.webhook_state.is_(None),
        _all_jobs_ended())))


@dataclass(frozen=True, slots=True)
class BatchAttempt:
    batch: Batch  # as read after the attempt was taken
    number: int  # 1 for the first attempt


def begin_batch_attempt(session: Session, batch_id: str, *, hold_seconds: float,
                        now: datetime | None = None) -> BatchAttempt | None:
    """Takes the next attempt at the batch's batch.completed and commits; None when none is due
    now (not owed, settled, due later, or running elsewhere)."""
    now = now or utcnow()
    number = _guarded(
        session, update(Batch)
        .where(Batch.id == batch_id, Batch.webhook_state == PENDING,
               Batch.webhook_next_attempt_at <= now)
        .values(webhook_attempts=Batch.webhook_attempts + 1,
                webhook_next_attempt_at=now + timedelta(seconds=hold_seconds))
        .returning(Batch.webhook_attempts))
    if number is None:
        return None
    batch = session.scalars(select(Batch).where(Batch.id == batch_id)
                            .execution_options(populate_existing=True)).one()
    return BatchAttempt(batch=batch, number=int(number))


def settle_batch_attempt(session: Session, batch_id: str, number: int, state: str, *,
                         retry_at: datetime | None = None) -> str | None:
    """Records how attempt ``number`` went and commits: `DELIVERED`, `FAILED` or `UNWANTED`, or
    `PENDING` again from ``retry_at``. None (nothing written) when a later attempt took over."""
    values: dict[str, object] = {"webhook_state": state}
    if retry_at is not None:
        values["webhook_next_attempt_at"] = retry_at
    settled = _guarded(
        session, update(Batch)
        .where(Batch.id == batch_id, Batch.webhook_state == PENDING,
               Batch.webhook_attempts == number)
        .values(**values)
        .returning(Batch.webhook_state))
    return None if settled is None else str(settled)


def owed_batches(session: Session, *, now: datetime | None = None,
                 first_by: datetime | None = None, limit: int = 500) -> list[str]:
    """Ids of batches whose batch.completed is owed and due at ``now``: pending with its retry
    (or a died attempt's hold) due; or, when its last job ended by ``first_by`` (default
    ``now``; a later one's task is still on its way), the decision never made or the event owed
    and never attempted."""
    now = now or utcnow()
    first_by = first_by or now
    ids = list(session.scalars(
        select(Batch.id)
        .where(Batch.webhook_url.is_not(None),
               or_(and_(Batch.webhook_state.is_(None), _all_jobs_ended(ended_by=first_by)),
                   and_(Batch.webhook_state == PENDING, Batch.webhook_next_attempt_at <= now,
                        or_(Batch.webhook_attempts > 0,
                            Batch.webhook_next_attempt_at <= first_by))))
        .order_by(Batch.created_at)
        .limit(limit)))
    session.rollback()  # end the read transaction
    return ids


# ---- job.started and job.progress: a row while a retry is owed -------------------------------
#
# A live event's first attempt is made by the task the worker group enqueued, with no row. When
# an attempt fails and is to be tried again, the event is written here with the time of its next
# attempt; the sweeper finds it once due (`owed_live`), each retry is leased on the row as a final
# event's attempt is (`begin_live_attempt`), and the row goes once the event is delivered or
# given up (`settle_live_attempt`).

def hold_live_retry(session: Session, *, msg_id: str, job_id: str, url: str, event: str,
                    body: str, attempt: int, retry_at: datetime,
                    now: datetime | None = None) -> bool:
    """Records that live event ``msg_id`` failed its first attempt (number ``attempt``) and is
    due again at ``retry_at``; commits. False (nothing written) when a row for it exists already
    (the first attempt's task ran twice) or its job is gone."""
    try:
        session.execute(insert(LiveWebhookRetry).values(
            msg_id=msg_id, job_id=job_id, url=url, event=event, body=body, attempts=attempt,
            next_attempt_at=retry_at, created_at=now or utcnow()))
        session.commit()
        return True
    except IntegrityError:
        session.rollback()
        return False


def owed_live(session: Session, *, now: datetime | None = None,
              limit: int = 500) -> list[tuple[str, str]]:
    """The live events whose retry (or a died attempt's hold) is due at ``now``, the longest
    due first: (job id, ``msg_id``) each."""
    now = now or utcnow()
    rows = session.execute(
        select(LiveWebhookRetry.job_id, LiveWebhookRetry.msg_id)
        .where(LiveWebhookRetry.next_attempt_at <= now)
        .order_by(LiveWebhookRetry.next_attempt_at).limit(limit)).all()
    session.rollback()  # end the read transaction
    return [(job_id, msg_id) for job_id, msg_id in rows]


@dataclass(frozen=True, slots=True)
class LiveAttempt:
    msg_id: str
    job_id: str
    url: str
    event: str
    body: str
    number: int  # 2 for the first retry


def begin_live_attempt(session: Session, msg_id: str, *, hold_seconds: float,
                       now: datetime | None = None) -> LiveAttempt | None:
    """Takes the next attempt at live event ``msg_id`` and commits; None when none is due now
    (delivered or given up, due later, or running elsewhere)."""
    now = now or utcnow()
    row = session.execute(
        update(LiveWebhookRetry)
        .where(LiveWebhookRetry.msg_id == msg_id, LiveWebhookRetry.next_attempt_at <= now)
        .values(attempts=LiveWebhookRetry.attempts + 1,
                next_attempt_at=now + timedelta(seconds=hold_seconds))
        .returning(LiveWebhookRetry.job_id, LiveWebhookRetry.url, LiveWebhookRetry.event,
                   LiveWebhookRetry.body, LiveWebhookRetry.attempts)).one_or_none()
    if row is None:
        session.rollback()
        return None
    session.commit()
    return LiveAttempt(msg_id=msg_id, job_id=row.job_id, url=row.url, event=row.event,
                       body=row.body, number=int(row.attempts))


def settle_live_attempt(session: Session, msg_id: str, number: int, *,
                        retry_at: datetime | None) -> bool:
    """Records how attempt ``number`` at live event ``msg_id`` went and commits: due again at
    ``retry_at``, or (None) delivered or given up, and the row deleted. False (nothing written)
    when a later attempt took over."""
    mine = and_(LiveWebhookRetry.msg_id == msg_id, LiveWebhookRetry.attempts == number)
    change: Any = (update(LiveWebhookRetry).where(mine).values(next_attempt_at=retry_at)
                   if retry_at is not None else delete(LiveWebhookRetry).where(mine))
    return _guarded(session, change.returning(LiveWebhookRetry.msg_id)) is not None


# ---- the delivery log ---------------------------------------------------------------------------

def log_attempt(session: Session, *, event: str, msg_id: str, attempt: int, outcome: str,
                status: int | None = None, error: str | None = None, job_id: str | None = None,
                batch_id: str | None = None, at: datetime | None = None) -> None:
    """Adds one attempt to the delivery log and commits."""
    session.execute(insert(WebhookAttempt).values(
        job_id=job_id, batch_id=batch_id, event=event, msg_id=msg_id[:100], attempt=attempt,
        at=at or utcnow(), status=status, error=error, outcome=outcome))
    session.commit()


@dataclass(frozen=True, slots=True)
class DeliveryLog:
    final: WebhookDelivery | None  # the outbox record of the job's final event, if it has one
    attempts: list[WebhookAttempt]  # the newest first
    num_attempts: int  # all of them, also those left out of ``attempts``


def delivery_log(session: Session, job_id: str, *, limit: int = 50) -> DeliveryLog:
    """A job's webhook attempts, the newest ``limit`` of them, and its final event's record."""
    attempts = list(session.scalars(select(WebhookAttempt).where(WebhookAttempt.job_id == job_id)
                                    .order_by(WebhookAttempt.id.desc()).limit(limit)))
    total = len(attempts)
    if total == limit:
        total = int(session.scalar(select(func.count()).select_from(WebhookAttempt)
                                   .where(WebhookAttempt.job_id == job_id)) or 0)
    return DeliveryLog(final=session.get(WebhookDelivery, job_id), attempts=attempts,
                       num_attempts=total)
