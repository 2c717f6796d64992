"""The job repository: submit, read, list, cancel, and the guarded state transitions.

Every state change is ONE conditional UPDATE whose WHERE names the state it expects (and, for a
running job, the attempt token of the attempt making the change), written together with its
`JobEvent` in one transaction and committed here. A write from an attempt that lost its lease
therefore matches no row and changes nothing; the caller sees ``None``/``False`` and must stop.
The two hottest writes, a submit and a claim, are on PostgreSQL each ONE statement (the row and
its event in data-modifying ``WITH`` clauses) run in autocommit: atomic on its own, and one
round trip instead of ``BEGIN``, the writes and ``COMMIT``.

A submit with an idempotency key the owner already used returns the job that key made
(`create_or_replay`, which batch submits share), also when the two requests race.

Worker side, in order (all take ``now`` for tests; it defaults to the current UTC time):

- `claim_job(session, job_id, worker_group_id=..., rank=..., lease_seconds=...)` -> `Claim | None`
  queued -> running with a fresh attempt token and lease; None if someone else got it, it was
  cancelled, is not yet due (``not_before``), is past its deadline, or has used its attempts.
- `heartbeat(session, job_id, token, step=..., total=..., lease_seconds=...)` -> `Beat | None`
  renews the lease and records progress; ``Beat.cancel_requested`` tells the rank to stop after
  this step; None means the attempt is no longer current: drop the job without writing anything.
- `finish_succeeded(session, job_id, token, video_key=..., thumbnail_key=...)` -> bool
- `finish_cancelled(session, job_id, token)` -> bool (after seeing ``cancel_requested``)
- `fail_job(session, job_id, token, error=..., retryable=False)` -> new state or None
- `reap(session)` -> `Reaped`: expired leases back to queued (or dead after ``max_attempts``,
  or cancelled if a cancel was pending) and queued jobs past their deadline to expired. Run it
  periodically; put `Reaped.requeued` back in the Redis ready index (`storage.ready.add`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Integer,
    and_,
    bindparam,
    case,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from storage.models import (
    JOB_ID_LENGTH,
    TERMINAL_STATES,
    Batch,
    Job,
    JobClass,
    JobEvent,
    JobState,
    User,
    utcnow,
)

MIN_PRIORITY = 0
MAX_PRIORITY = 9
DEFAULT_PRIORITY = 5
MAX_SEED = 2**63 - 1
_ID_ALPHABET = string.ascii_lowercase + string.digits
# Ordering of classes for queue position: interactive work always goes first.
_CLASS_RANK = {JobClass.INTERACTIVE.value: 0, JobClass.BATCH.value: 1}

_Keyed = TypeVar("_Keyed", Job, Batch)  # a row that an idempotency key names
_Made = TypeVar("_Made")


class IdempotencyConflict(ValueError):
    """The idempotency key was already used by this user for a different request."""


class QueueFull(Exception):
    """The user already has the maximum number of queued jobs (or would, with ``adding`` more)."""

    def __init__(self, limit: int, *, queued: int | None = None, adding: int = 1) -> None:
        if adding == 1:
            message = f"you already have {limit} queued jobs, the most allowed; retry later"
        else:
            message = (f"you have {queued} queued jobs and these {adding} would pass the limit "
                       f"of {limit}; retry when fewer are queued")
        super().__init__(message)
        self.limit = limit


class JobBusy(ValueError):
    """The job is running and the operation needs it queued or finished."""


def new_job_id() -> str:
    """20 lowercase letters and digits (~103 random bits): safe in URLs, paths and shells."""
    # One draw from the OS (not one per character), written in base 36.
    n = secrets.randbelow(len(_ID_ALPHABET) ** JOB_ID_LENGTH)
    chars = []
    for _ in range(JOB_ID_LENGTH):
        n, digit = divmod(n, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[digit])
    return "".join(chars)


def is_job_id(value: str) -> bool:
    return len(value) == JOB_ID_LENGTH and all(c in _ID_ALPHABET for c in value)


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """A validated request: what the renderer needs plus scheduling hints."""

    model: str
    prompt: str
    negative_prompt: str | None = None
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int | None = None  # None: drawn now, so that a retried attempt renders the same video
    job_class: JobClass = JobClass.INTERACTIVE
    priority: int = DEFAULT_PRIORITY
    not_before: datetime | None = None
    deadline: datetime | None = None
    webhook_url: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    batch_id: str | None = None
    batch_index: int | None = None  # 1-based line in its batch submission


@dataclass(frozen=True, slots=True)
class Created:
    job: Job
    created: bool  # False: an idempotent replay returned the job made earlier
    # The owner's queued jobs before this one, when ``max_queued`` made create_job count them
    # (counted up to the limit).
    queued_before: int | None = None


def create_job(
    session: Session,
    owner: User,
    spec: JobSpec,
    *,
    request_hash: str,
    idempotency_key: str | None = None,
    max_attempts: int = 3,
    max_queued: int | None = None,
    now: datetime | None = None,
) -> Created:
    """Stores a queued job and commits. Tell Redis (`storage.ready.add`) only after this returns.

    Raises `IdempotencyConflict` when the key was used with another request, `QueueFull` when
    the owner already has ``max_queued`` queued jobs (an idempotent replay is never refused).
    """
    now = now or utcnow()

    def insert_job() -> Created:
        job = new_job_row(owner.id, spec, request_hash=request_hash,
                          idempotency_key=idempotency_key, max_attempts=max_attempts, now=now)
        queued = _insert_created(session, job, now, max_queued)
        return Created(job=job, created=True, queued_before=queued)

    return create_or_replay(session, Job, owner.id, idempotency_key, request_hash,
                            create=insert_job, replay=lambda job: Created(job=job, created=False))


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


def _insert_created(session: Session, job: Job, now: datetime,
                    max_queued: int | None) -> int | None:
    """Checks the owner's queue room (unless ``max_queued`` is None), inserts ``job``
    (transient) and its ``created`` event, commits, then attaches the row to ``session`` as if
    it had been loaded. Returns the owner's queued jobs counted before it, if it counted.

    A submit is the API's hottest path, so it is prebuilt statements with bound parameters
    rather than the unit of work (whose flush of two new objects costs more CPU than the
    statements). On PostgreSQL it is ONE statement run outside a transaction: the room check,
    the row and its event in data-modifying ``WITH`` clauses, so a submit is one round trip
    instead of five (``BEGIN``, the count, the row, the event, ``COMMIT``); a single statement
    is atomic on its own. SQLite has no ``INSERT`` inside ``WITH``: there it is the count and two
    plain ``INSERT``s in one transaction.
    """
    params = {}
    for attr in sa_inspect(Job).column_attrs:
        if attr.key not in job.__dict__:
            set_committed_value(job, attr.key, None)  # as loaded: no lazy load on first read
        params[f"new_{attr.columns[0].key}"] = getattr(job, attr.key)
    params.update(event_at=now, event_kind="created", event_attempt=0, event_detail={})
    queued = None
    if session.get_bind().dialect.name == "postgresql":
        params["max_queued"] = max_queued
        stmt = _submit_statement(check_room=max_queued is not None)
        queued, added = _autocommit(session).execute(stmt, params).one()
        session.commit()  # no round trip: autocommit left no transaction open
        if not added:
            raise QueueFull(max_queued or 0, queued=queued)
    else:
        if max_queued is not None:
            queued = check_queue_room(session, job.owner_id, max_queued)
        for stmt in _created_statements():
            session.execute(stmt, params)
        session.commit()
    make_transient_to_detached(job)
    session.add(job)
    return queued if max_queued is not None else None


def _autocommit(session: Session) -> Connection:
    """The session's connection in autocommit mode, for ONE statement that is atomic on its own
    (PostgreSQL runs each statement in a transaction of its own): no ``BEGIN`` and ``COMMIT``
    round trips around it. A read transaction the session has open is committed first. Call
    ``session.commit()`` after the statement to give the connection back."""
    if session.in_transaction():
        session.commit()
    return session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})


def _event_values() -> dict[str, Any]:
    events = JobEvent.__table__
    return {"at": bindparam("event_at", type_=events.c.at.type),
            "kind": bindparam("event_kind", type_=events.c.kind.type),
            "attempt": bindparam("event_attempt", type_=events.c.attempt.type),
            "detail": bindparam("event_detail", type_=events.c.detail.type)}


@functools.cache
def _submit_statement(*, check_room: bool) -> Any:
    """PostgreSQL: ``(queued, added)`` -- the owner's queued jobs counted up to ``max_queued``
    (0 without ``check_room``), and 1 if the job and its event were inserted (with
    ``check_room``, only when that count is under the limit), else 0. Built once, so each submit
    only binds its values."""
    jobs_table, events_table = Job.__table__, JobEvent.__table__
    # Parameter names must differ from the column names, which insert() reserves.
    room = select(func.count().label("queued")).select_from(
        select(jobs_table.c.id)
        .where(jobs_table.c.owner_id == bindparam("new_owner_id", type_=Integer),
               jobs_table.c.state == JobState.QUEUED)
        .limit(bindparam("max_queued", type_=Integer))
        .subquery("capped")
    ).cte("room")
    # Typed parameters: the dialect casts each (``%(new_width)s::INTEGER``), so an INSERT ...
    # SELECT of parameters does not leave their types to inference.
    values = [bindparam(f"new_{c.key}", type_=c.type) for c in jobs_table.c]
    new_row = select(*values)
    if check_room:
        new_row = new_row.where(select(room.c.queued).scalar_subquery()
                                < bindparam("max_queued", type_=Integer))
    added_job = (insert(jobs_table).from_select(list(jobs_table.c), new_row)
                 .returning(jobs_table.c.id).cte("added_job"))
    event = _event_values()
    added_event = (insert(events_table)
                   .from_select(["job_id", *event], select(added_job.c.id, *event.values()))
                   .returning(events_table.c.job_id).cte("added_event"))
    num_added = select(func.count()).select_from(added_event).scalar_subquery()
    if check_room:
        return select(room.c.queued, num_added)
    return select(literal(0, Integer), num_added)


@functools.cache
def _created_statements() -> tuple[Any, Any]:
    """SQLite: (the job, its event), built once so that each submit only binds its values."""
    jobs_table, events_table = Job.__table__, JobEvent.__table__
    add_job = insert(jobs_table).values({c: bindparam(f"new_{c.key}", type_=c.type)
                                         for c in jobs_table.c})
    add_event = insert(events_table).values(job_id=bindparam("new_id"), **_event_values())
    return add_job, add_event


def check_queue_room(session: Session, owner_id: int, max_queued: int, adding: int = 1) -> int:
    """Raises `QueueFull` unless the owner may queue ``adding`` more jobs; returns the owner's
    queued jobs (counted up to ``max_queued``).

    Two concurrent submits may both pass this count; the limit is a guard against runaway
    clients, not an exact quota, so a few extra jobs are acceptable.
    """
    params = {"owner_id": owner_id, "max_queued": max_queued}
    num_queued = int(session.scalar(_count_queued_statement(), params) or 0)
    if num_queued + adding > max_queued:
        raise QueueFull(max_queued, queued=num_queued, adding=adding)
    return num_queued


@functools.cache
def _count_queued_statement() -> Any:
    """The owner's queued jobs, counted up to ``max_queued``; built once, since every submit
    runs it (building and keying a statement costs more CPU than binding one)."""
    # LIMIT bounds the work: a submit never counts more rows than the limit.
    capped = (
        select(Job.id)
        .where(Job.owner_id == bindparam("owner_id"), Job.state == JobState.QUEUED)
        .limit(bindparam("max_queued", type_=Integer))
        .subquery()
    )
    return select(func.count()).select_from(capped)


def new_job_row(owner_id: int, spec: JobSpec, *, request_hash: str,
                idempotency_key: str | None, max_attempts: int, now: datetime) -> Job:
    """The queued row for ``spec``, not yet added to a session."""
    return Job(
        id=new_job_id(),
        owner_id=owner_id,
        batch_id=spec.batch_id,
        batch_index=spec.batch_index,
        model=spec.model,
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt,
        width=spec.width,
        height=spec.height,
        num_frames=spec.num_frames,
        fps=spec.fps,
        num_inference_steps=spec.num_inference_steps,
        guidance_scale=spec.guidance_scale,
        seed=spec.seed if spec.seed is not None else secrets.randbelow(2**31),
        class_=JobClass(spec.job_class).value,
        priority=spec.priority,
        not_before=spec.not_before,
        deadline=spec.deadline,
        webhook_url=spec.webhook_url,
        meta=dict(spec.metadata),
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        state=JobState.QUEUED.value,
        attempts=0,
        max_attempts=max_attempts,
        progress_step=0,
        progress_total=spec.num_inference_steps,
        cancel_requested=False,
        created_at=now,
    )


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


def encode_cursor(row: Job | Batch) -> str:
    """A keyset cursor after ``row`` (a job or a batch: both ids look alike)."""
    raw = f"{row.created_at.isoformat()}|{row.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError for anything that `encode_cursor` did not make."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, job_id = raw.split("|", 1)
        created = datetime.fromisoformat(stamp)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError("cursor is not one this API returned") from exc
    if created.tzinfo is None or not is_job_id(job_id):
        raise ValueError("cursor is not one this API returned")
    return created, job_id


def list_jobs(
    session: Session,
    user: User,
    *,
    states: Sequence[str] = (),
    model: str | None = None,
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


def _event(session: Session, job_id: str, kind: str, now: datetime, attempt: int = 0,
           **detail: Any) -> None:
    session.execute(
        insert(JobEvent).values(job_id=job_id, at=now, kind=kind, attempt=attempt, detail=detail)
    )


def _update(*where: Any, **values: Any) -> Any:
    """The conditional UPDATE of the jobs where ``where`` holds, returning the updated rows."""
    return (
        update(Job)
        .where(*where)
        .values(**values)
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    )


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


def request_cancel(
    session: Session, job_id: str, user: User, *, now: datetime | None = None
) -> tuple[Job, bool] | None:
    """Cancels a queued job at once, or flags a running one for its rank to stop after the
    current step. Returns (job, was_queued) -- remove a was-queued job from the ready index --
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
        row = _autocommit(session).execute(both, params).mappings().one_or_none()
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
    jobs_table, events_table = Job.__table__, JobEvent.__table__
    now = bindparam("claim_now", type_=jobs_table.c.started_at.type)
    claim = (
        update(jobs_table)
        .where(jobs_table.c.id == bindparam("claim_id"),
               jobs_table.c.state == JobState.QUEUED.value,
               jobs_table.c.cancel_requested.is_(False),
               jobs_table.c.attempts < jobs_table.c.max_attempts,
               or_(jobs_table.c.not_before.is_(None), jobs_table.c.not_before <= now),
               or_(jobs_table.c.deadline.is_(None), jobs_table.c.deadline > now))
        .values(state=JobState.RUNNING.value, attempts=jobs_table.c.attempts + 1,
                attempt_token=bindparam("claim_token"),
                lease_expires_at=bindparam("claim_lease", type_=jobs_table.c.started_at.type),
                worker_group_id=bindparam("claim_group"), rank=bindparam("claim_rank"),
                progress_step=0, progress_total=jobs_table.c.num_inference_steps, started_at=now)
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
    total: int | None = None,
    lease_seconds: float,
    now: datetime | None = None,
) -> Beat | None:
    """Renews the lease and records progress (no event: one per step would flood the table)."""
    now = now or utcnow()
    lease = now + timedelta(seconds=lease_seconds)
    values: dict[str, Any] = {"lease_expires_at": lease}
    if step is not None:
        values["progress_step"] = step
    if total is not None:
        values["progress_total"] = total
    job = _transition(session, job_id, attempt=attempt_token, event=None, now=now, **values)
    if job is None:
        return None
    return Beat(cancel_requested=job.cancel_requested, lease_expires_at=lease)


def finish_succeeded(
    session: Session,
    job_id: str,
    attempt_token: str,
    *,
    video_key: str,
    thumbnail_key: str | None = None,
    now: datetime | None = None,
) -> bool:
    """running -> succeeded; False (nothing written) if this attempt is no longer current."""
    now = now or utcnow()
    started = session.scalar(
        select(Job.started_at).where(Job.id == job_id, Job.attempt_token == attempt_token)
    )
    job = _transition(
        session, job_id, attempt=attempt_token, event="succeeded",
        detail=lambda job: {"render_seconds": job.render_seconds}, now=now,
        state=JobState.SUCCEEDED.value, finished_at=now, lease_expires_at=None,
        progress_step=Job.progress_total, output_video_key=video_key,
        output_thumbnail_key=thumbnail_key,
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
    now: datetime | None = None,
) -> JobState | None:
    """Ends this attempt with an error. Not retryable -> failed. Retryable (the worker, not the
    request, was at fault) -> queued again while attempts remain, else dead. Returns the new
    state, or None if the attempt is no longer current. A job back in `queued` must be re-added
    to the ready index by the caller.
    """
    now = now or utcnow()
    detail = {"error": error, "code": code}
    if retryable and _transition(
        session, job_id, Job.attempts < Job.max_attempts, Job.cancel_requested.is_(False),
        attempt=attempt_token, event="requeued", detail=detail, now=now, keep_open=True,
        **_requeue_values(error, code),
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
    requeued: list[Job] = field(default_factory=list)  # add these back to the ready index
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
    for job in bulk(*lapsed, Job.attempts >= Job.max_attempts,
                    state=JobState.DEAD.value, finished_at=now, lease_expires_at=None,
                    error=f"gave up after its last allowed attempt: {lost}", error_code="dead"):
        out.dead.append(job.id)
        _event(session, job.id, "dead", now, job.attempts, reason="lease expired")
    for job in bulk(*lapsed, **_requeue_values(lost, "lease_expired")):
        out.requeued.append(job)
        _event(session, job.id, "requeued", now, job.attempts, reason="lease expired")
    for job in bulk(Job.state == JobState.QUEUED, Job.deadline < now,
                    state=JobState.EXPIRED.value, finished_at=now,
                    error="its deadline passed before it could start", error_code="expired"):
        out.expired.append(job.id)
        _event(session, job.id, "expired", now, job.attempts)
    session.commit()
    return out


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
