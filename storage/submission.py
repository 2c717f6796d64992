"""Creating jobs: the validated request (`JobSpec`), its queued row, and the submit that writes
the row with its ``created`` event and commits (the API's writer).

A submit is the API's hottest write: on PostgreSQL it is ONE prebuilt statement (the room check,
the row and its event in data-modifying ``WITH`` clauses) run in autocommit, atomic on its own
and one round trip. A submit with an idempotency key the owner already used returns the job that
key made (`storage.idempotency.create_or_replay`).
"""

from __future__ import annotations

import functools
import secrets
import string
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Integer, Table, bindparam, func, insert, literal, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Session, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from common.render import RenderFields
from storage.db import autocommit
from storage.idempotency import create_or_replay
from storage.tables import (
    DEFAULT_PRIORITY,
    JOB_ID_LENGTH,
    Job,
    JobClass,
    JobEvent,
    JobState,
    User,
    utcnow,
)

_ID_ALPHABET = string.ascii_lowercase + string.digits


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


@dataclass(kw_only=True, frozen=True, slots=True)
class JobSpec(RenderFields):
    """A validated request: the model, its render fields (a ``seed`` of None is drawn when the
    row is made), and scheduling hints."""

    model: str
    job_class: JobClass = JobClass.INTERACTIVE
    priority: int = DEFAULT_PRIORITY
    not_before: datetime | None = None
    deadline: datetime | None = None
    webhook_url: str | None = None
    webhook_events: list[str] | None = None  # None: the final events only
    metadata: dict[str, Any] = field(default_factory=dict)
    batch_id: str | None = None
    batch_index: int | None = None  # 1-based line in its batch submission
    # What the render starts from: an upload of the owner (`storage.input_files`), checked at
    # the door; how it is fitted to the size; video-to-video strength; the soundtrack (None:
    # the model's default).
    input_file_id: str | None = None
    input_fit: str | None = None
    input_role: str | None = None  # "extend": see `storage.tables.Job.input_role`
    source_job_id: str | None = None
    strength: float | None = None
    audio: bool | None = None
    # LoRA adapters, [{"id", "scale"}] in the order given (checked at the door); None: none.
    adapters: list[dict[str, Any]] | None = None
    quality: str | None = None  # `common.quality`; None: exact


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
    """Stores a queued job and commits. Tell Redis (`scheduler.queue_index.add`) only after this
    returns.

    Raises `storage.idempotency.IdempotencyConflict` when the key was used with another request,
    `QueueFull` when the owner already has ``max_queued`` queued jobs (an idempotent replay is
    never refused).
    """
    now = now or utcnow()

    def insert_job() -> Created:
        job = new_job_row(owner.id, spec, request_hash=request_hash,
                          idempotency_key=idempotency_key, max_attempts=max_attempts, now=now)
        queued = _insert_created(session, job, now, max_queued)
        return Created(job=job, created=True, queued_before=queued)

    return create_or_replay(session, Job, owner.id, idempotency_key, request_hash,
                            create=insert_job, replay=lambda job: Created(job=job, created=False))


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
        queued, added = autocommit(session).execute(stmt, params).one()
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


def _tables() -> tuple[Table, Table]:
    """The jobs and job events tables (declarative types them as any FROM clause)."""
    return cast(Table, Job.__table__), cast(Table, JobEvent.__table__)


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
    jobs_table, events_table = _tables()
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
    jobs_table, events_table = _tables()
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
        webhook_events=list(spec.webhook_events) if spec.webhook_events is not None else None,
        meta=dict(spec.metadata),
        input_file_id=spec.input_file_id,
        input_fit=spec.input_fit,
        input_role=spec.input_role,
        source_job_id=spec.source_job_id,
        strength=spec.strength,
        audio=spec.audio,
        adapters=[dict(a) for a in spec.adapters] if spec.adapters else None,
        quality=spec.quality,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        state=JobState.QUEUED.value,
        attempts=0,
        uncharged_attempts=0,
        max_attempts=max_attempts,
        preemptions=0,
        progress_step=0,
        progress_total=spec.num_inference_steps,  # the progress report's step count
        cancel_requested=False,
        created_at=now,
    )
