"""Celery side work on kiln's Redis: webhooks, the lease reaper, queue-index reconciliation and
output retention, with the beat schedule that runs the periodic ones.

Tasks are thin adapters. Each takes ids, re-reads the rows, checks their state and is safe to run
twice (``acks_late``: a task whose worker died is delivered again). The work itself lives in plain
functions taking a `Context` (`deliver`, `deliver_batch`, `deliver_logged`, `redeliver_live`,
`sweep`, `sweep_batches`, `sweep_live`, `reap_leases`, `reconcile`, `clean_up`), which the tests
call directly against a real database and Redis.

Nothing here is the only copy of a fact: the database says which jobs are finished and still owe a
webhook, which batches have ended and owe batch.completed (`storage.webhooks`), which leases
lapsed, what is queued and what is old, so a lost task is made good by the next periodic run.

Webhook retries are the outbox's alone: an attempt that failed and is to be tried again writes
the time of the next one to its outbox row and its task ends; the sweeper (`kiln.sweep_webhooks`,
every ``webhook_sweep_interval_seconds``) finds the rows that are due and enqueues their next
attempt. A retry so goes out between its time and one sweep interval later, plus the queue's
wait. Celery retries nothing.

The app and its tasks come from `make_celery` (settings in, a configured app out): each process
that runs or enqueues the side work builds its own. Run it with ``kiln celery`` (worker with
embedded beat), or ``kiln celery worker`` and ``kiln celery beat`` as separate processes
(production: exactly one beat); Celery's own command line takes ``-A kiln.celery_app``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from celery import Celery, Task, signals
from pydantic import SecretStr, TypeAdapter
from redis import Redis, RedisError
from sqlalchemy.orm import Session, sessionmaker

from common import logs, netguard, retry
from common.settings import Settings, get_settings
from kiln import signing, webhook_client
from kiln.webhook_client import Posted
from scheduler import queue_index
from scheduler.attempts import settle
from storage import batches, input_files, lifecycle, queries, retention, webhook_secrets, webhooks
from storage.db import make_engine, make_session_factory
from storage.outputs import OutputStore, checkpoint_key, make_store
from storage.tables import Batch, Job, JobState, utcnow

log = logging.getLogger(__name__)

USER_AGENT = "kiln-webhooks/0.1"
# The sweeper leaves the first attempt at a job's (or batch's) event to the task enqueued when it
# ended, for this long: that task is probably still on its way. Retries are the sweeper's own and
# go out once due.
SWEEP_GRACE_SECONDS = 30.0
_CLEAN_UP_CHUNK = 200
# batch.completed lists this many of the failed, expired and dead jobs (``counts`` has them all,
# the report route every job): a receiver's body stays small for a batch of thousands.
MAX_EVENT_PROBLEMS = 100

def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings for a deployment: its Redis, its key prefix, late acks."""
    # Celery's keys live under kiln's prefix, so several deployments (and tests) share one Redis.
    keyprefix = f"{settings.redis_prefix}celery:"
    return dict(
        broker_url=settings.redis_url,
        result_backend=settings.redis_url,
        broker_transport_options={
            "global_keyprefix": keyprefix,
            # An unacknowledged task is re-delivered after this; see the setting's comment.
            "visibility_timeout": settings.celery_visibility_timeout_seconds,
            "socket_connect_timeout": 5,
        },
        result_backend_transport_options={"global_keyprefix": keyprefix},
        result_expires=timedelta(days=1),
        # Acknowledge after the task ran, so a worker that dies mid-task loses nothing; fetch one
        # at a time, so a busy worker does not sit on tasks another could run.
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        # A task that kills its worker is not requeued (it could kill every worker in turn); the
        # periodic sweeps pick its work up again from the database.
        task_reject_on_worker_lost=False,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        enable_utc=True,
        timezone="UTC",
        broker_connection_retry_on_startup=True,
        beat_schedule=beat_schedule(settings),
        # Beat's record of the last runs belongs to the deployment, beside its other state,
        # not to a temporary directory that is shared and cleaned behind its back.
        beat_schedule_filename=str(beat_schedule_path(settings)),
    )


def beat_schedule_path(settings: Settings) -> Path:
    """Where beat keeps its schedule: under ``data_dir``, one file per Redis prefix."""
    return (settings.data_dir / f"celery-beat-{_safe(settings.redis_prefix)}").absolute()


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    def every(seconds: float, task: str) -> dict[str, Any]:
        # A periodic run not started within one period is dropped: the next one does its work.
        return {"task": task, "schedule": seconds, "options": {"expires": seconds}}

    return {
        "reap-leases": every(settings.reaper_interval_seconds, "kiln.reap_leases"),
        "reconcile-ready-index": every(settings.reconcile_interval_seconds,
                                       "kiln.reconcile_ready_index"),
        "sweep-webhooks": every(settings.webhook_sweep_interval_seconds, "kiln.sweep_webhooks"),
        "clean-up-outputs": every(settings.retention_interval_seconds, "kiln.clean_up_outputs"),
    }


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_") or "kiln"


@signals.setup_logging.connect
def _setup_logging(loglevel: int | None = None, **_: Any) -> None:
    """Celery's worker and beat log through kiln's configuration (`common.logs`), at the level
    Celery was given, instead of putting handlers of their own on the root logger."""
    settings = get_settings()
    level = logging.getLevelName(loglevel) if loglevel else settings.log_level
    logs.configure(level, settings.log_format, process="celery")


# What a task is about, from its arguments: every line logged while it runs carries it,
# Celery's own "succeeded" line included (it comes before task_postrun).
_ABOUT: dict[str, Callable[[tuple[Any, ...]], dict[str, object]]] = {
    "kiln.deliver_webhook": lambda args: {"job": args[0]},
    "kiln.deliver_batch_webhook": lambda args: {"batch": args[0]},
    "kiln.deliver_event": lambda args: {"job": json.loads(args[3])["data"]["id"]},
    "kiln.retry_event": lambda args: {"job": args[0]},
}
_running: dict[str, contextlib.ExitStack] = {}  # task id -> its `logs.bound` block


@signals.task_prerun.connect
def _bind_task(task_id: str, task: Task, args: tuple[Any, ...] = (), **_: Any) -> None:
    about = _ABOUT.get(task.name)
    if about is None:
        return
    block = contextlib.ExitStack()
    block.enter_context(logs.bound(**about(args)))
    _running[task_id] = block


@signals.task_postrun.connect
def _unbind_task(task_id: str, **_: Any) -> None:
    block = _running.pop(task_id, None)
    if block is not None:
        block.close()


# ---- the work, as plain functions ---------------------------------------------------------------

@dataclass(kw_only=True)
class Context:
    """What the task bodies need; built once per worker process from the settings."""

    settings: Settings
    sessions: sessionmaker[Session]
    redis: Redis
    store: OutputStore


def make_context(settings: Settings) -> Context:
    if settings.redis_url is None:
        raise ValueError("the Celery side work needs REDIS_URL (kiln up sets it)")
    return Context(
        settings=settings,
        sessions=make_session_factory(make_engine(settings.database_url)),
        redis=Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5),
        store=make_store(settings),
    )


def job_data(job: Job) -> dict[str, Any]:
    """A job as its webhook events carry it (``data``); URLs are paths on the API."""
    done = job.state == JobState.SUCCEEDED
    error = None
    if job.state != JobState.SUCCEEDED and job.error is not None:
        error = {"code": job.error_code or job.state, "message": job.error}
    return {
        "id": job.id,
        "status": job.state,
        "model": job.model,
        "batch_id": job.batch_id,
        "attempts": job.attempts,
        "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "render_seconds": job.render_seconds,
        "video_url": f"/v1/jobs/{job.id}/video" if done and job.output_video_key else None,
        "thumbnail_url": (f"/v1/jobs/{job.id}/thumbnail"
                          if done and job.output_thumbnail_key else None),
        "has_audio": job.has_audio,  # whether the video has a soundtrack; null until written
        "error": error,
        "metadata": job.meta,
    }


def event(kind: str, at: datetime, data: dict[str, Any]) -> dict[str, Any]:
    """A webhook event, the Standard Webhooks way: its type, when it happened, its object."""
    return {"type": kind, "timestamp": at.isoformat(), "data": data}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def payload(job: Job) -> dict[str, Any]:
    """The final event of a finished job: ``job.<final state>``, at its finish."""
    return event(f"job.{job.state}", job.finished_at or job.created_at, job_data(job))


def final_event_id(job: Job) -> str:
    """The ``webhook-id`` of a job's final event: the same on every attempt."""
    return f"evt_{job.id}_{job.state}"


def started_event(job: Job) -> tuple[str, bytes]:
    """``job.started`` for the attempt just claimed: its id and body."""
    at = job.started_at or utcnow()
    return (f"evt_{job.id}_started_{job.attempts}",
            encode(event("job.started", at, job_data(job))))


def progress_event(job_id: str, attempt: int | None, step: int, total: int,
                   at: datetime | None = None) -> tuple[str, bytes]:
    """``job.progress``, made from what the worker group knows without reading the row."""
    at = at or utcnow()
    data = {"id": job_id, "status": JobState.RUNNING.value, "attempts": attempt,
            "step": step, "total_steps": total,
            "progress": round(step / total, 4) if total else 0.0}
    return (f"evt_{job_id}_progress_{attempt or 0}_{step}",
            encode(event("job.progress", at, data)))


def batch_event_id(batch_id: str) -> str:
    """The ``webhook-id`` of a batch's batch.completed: the same on every attempt."""
    return f"evt_{batch_id}_completed"


_REPORT_JSON = TypeAdapter(batches.Report)


def batch_payload(batch: Batch, report: batches.Report) -> dict[str, Any]:
    """batch.completed, at the batch's last finish: its report (counts, throughput, render time)
    with the first `MAX_EVENT_PROBLEMS` problems and without the per-job list, plus the batch's
    metadata and where the whole report is. The report is `storage.batches.report`'s, dumped to
    JSON as the API dumps its ``BatchReport``."""
    data = _REPORT_JSON.dump_python(report, mode="json", exclude={"jobs"})
    data["problems"] = data["problems"][:MAX_EVENT_PROBLEMS]
    data.update(metadata=batch.meta, report_url=f"/v1/batches/{batch.id}/report")
    return event(webhooks.BATCH_COMPLETED, report.finished_at or batch.created_at, data)


def backoff_seconds(settings: Settings, attempt: int) -> float:
    """The wait after failed attempt number ``attempt`` (1-based): doubling, capped, jittered
    (`common.retry`)."""
    return retry.backoff(attempt, first=settings.webhook_backoff_seconds,
                         cap=settings.webhook_backoff_max_seconds)


@dataclass(frozen=True, slots=True)
class Delivery:
    # "skipped" (nothing due), "delivered", "pending" (retry later), "failed", "unwanted" (the
    # job's filter leaves the event out: nothing sent)
    state: str
    attempt: int = 0
    status: int | None = None  # HTTP status of this attempt
    retry_in: float | None = None  # seconds until the next attempt (its outbox row has the time)
    error: str | None = None  # why this attempt did not deliver


def signing_secrets(s: Settings, owner: webhook_secrets.Secrets) -> list[str | SecretStr]:
    """What a delivery of ``owner``'s is signed with: the owner's secrets (the current one, and
    the one it replaced while that still signs), then the deployment's ``webhook_secret``, if
    set, for receivers that verify with that one."""
    found: list[str | SecretStr] = list(owner.signing)
    if s.webhook_secret is not None:
        found.append(s.webhook_secret)
    return found


def _post(s: Settings, url: str, *, secrets: list[str | SecretStr], msg_id: str, kind: str,
          body: bytes, attempt: int, delivery_id: str) -> Posted:
    """One signed POST of an event, to a checked address (`kiln.webhook_client`)."""
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Kiln-Delivery": delivery_id,  # stable across attempts: receivers drop repeats by it
        "Kiln-Event": kind,
        "Kiln-Attempt": str(attempt),
    }
    headers.update(signing.standard_headers(secrets, msg_id, body))
    return webhook_client.post(url, body=body, headers=headers,
                               private_allowed=netguard.private_allowed(s),
                               timeout_seconds=s.webhook_timeout_seconds)


def _retry_in(s: Settings, attempt: int, posted: Posted) -> float | None:
    """Seconds until the next attempt after ``posted``; None when it delivered or when this was
    the last try: out of attempts, 410 Gone (the receiver says this endpoint will never take
    it), or a refused destination (it stays refused)."""
    if posted.error is None or attempt >= s.webhook_max_attempts or posted.status == 410 \
            or posted.refused is not None:
        return None
    return backoff_seconds(s, attempt)


def _hold_seconds(s: Settings) -> float:
    # Long enough for the POST to finish or time out; after it, a died attempt is due again.
    return 3 * s.webhook_timeout_seconds + 30


def _destination(url: str) -> str:
    """A webhook URL as the log names it: its host and port only (its path or query may carry
    the receiver's own token)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def _outcome(posted: Posted, retry_in: float | None) -> str:
    """The delivery log's word for one attempt."""
    if posted.error is None:
        return "delivered"
    return "failed" if retry_in is None else "retrying"


def _log(session: Session, **attempt: Any) -> None:
    # The log is history, not state: failing to write it must not fail a delivery.
    try:
        webhooks.log_attempt(session, **attempt)
    except Exception:
        session.rollback()
        log.warning("could not log the webhook attempt %s", attempt.get("msg_id"), exc_info=True)


# ``record(posted, retry_at, at)``: settles an outbox attempt; the new state, or None when a
# later attempt has taken over.
Record = Callable[[Posted, datetime | None, datetime], str | None]


def _attempt(ctx: Context, session: Session, *, url: str, owner_id: int, msg_id: str, kind: str,
             body: bytes, number: int, now: datetime, record: Record, job_id: str | None = None,
             batch_id: str | None = None) -> Delivery:
    """Attempt ``number`` at an outbox event (a job's final one, a batch's) of user
    ``owner_id``: the POST, signed with that user's secrets, then the outbox row settled by
    ``record`` and the attempt in the delivery log."""
    owner = job_id or batch_id or ""
    secrets = signing_secrets(ctx.settings, webhook_secrets.ensure(session, owner_id, now=now))
    started = time.monotonic()
    posted = _post(ctx.settings, url, secrets=secrets, msg_id=msg_id, kind=kind, body=body,
                   attempt=number, delivery_id=owner)
    # The wait before a retry counts from the end of this attempt.
    at = now + timedelta(seconds=time.monotonic() - started)
    retry_in = _retry_in(ctx.settings, number, posted)
    state = record(posted, None if retry_in is None else at + timedelta(seconds=retry_in), at)
    _log(session, job_id=job_id, batch_id=batch_id, event=kind, msg_id=msg_id, attempt=number,
         status=posted.status, error=posted.error, outcome=_outcome(posted, retry_in), at=at)
    about = logs.fields(job=job_id, batch=batch_id)
    if posted.error is None:
        log.info("webhook %s delivered to %s (HTTP %s, attempt %d)", kind, _destination(url),
                 posted.status, number, extra=about)
        return Delivery(state="delivered", attempt=number, status=posted.status)
    log.warning("webhook %s for %s, attempt %d: %s%s", kind, owner, number, posted.error,
                "; giving up" if retry_in is None else f"; retrying in {retry_in:.0f} s",
                extra=about)
    if state is None:  # a later attempt took over while this one overran its hold
        return Delivery(state="skipped", attempt=number, status=posted.status,
                        error=posted.error)
    return Delivery(state=state, attempt=number, status=posted.status, retry_in=retry_in,
                    error=posted.error)


def deliver(ctx: Context, job_id: str, *, now: datetime | None = None) -> Delivery:
    """One attempt at a finished job's webhook, if one is due; records the outcome."""
    now = now or utcnow()
    with ctx.sessions() as session:
        attempt = webhooks.begin_attempt(session, job_id, hold_seconds=_hold_seconds(ctx.settings),
                                         now=now)
        if attempt is None:
            return Delivery(state="skipped")
        job = attempt.job
        assert job.webhook_url is not None
        kind = f"job.{job.state}"
        if not webhooks.wants(job.webhook_events, kind):
            webhooks.settle_unwanted(session, job_id, attempt.number, now=now)
            return Delivery(state=webhooks.UNWANTED, attempt=attempt.number)

        def record(posted: Posted, retry_at: datetime | None, at: datetime) -> str | None:
            return webhooks.record_result(
                session, job_id, attempt.number, delivered=posted.error is None,
                status=posted.status, error=posted.error, retry_at=retry_at, now=at)

        return _attempt(ctx, session, url=job.webhook_url, owner_id=job.owner_id,
                        msg_id=final_event_id(job), kind=kind, body=encode(payload(job)),
                        number=attempt.number, now=now, record=record, job_id=job_id)


def deliver_batch(ctx: Context, batch_id: str, *, now: datetime | None = None) -> Delivery:
    """One attempt at a batch's batch.completed, if it is owed and due. Whether the batch has
    just completed is decided first, by `storage.webhooks.complete_batch`'s guarded UPDATE: of
    the tasks enqueued by jobs that ended at the same moment, one makes the event owed and one
    takes its attempt; the others skip."""
    now = now or utcnow()
    with ctx.sessions() as session:
        webhooks.complete_batch(session, batch_id, now=now)
        attempt = webhooks.begin_batch_attempt(
            session, batch_id, hold_seconds=_hold_seconds(ctx.settings), now=now)
        if attempt is None:
            return Delivery(state="skipped")
        batch = attempt.batch
        assert batch.webhook_url is not None
        if not webhooks.wants(batch.webhook_events, webhooks.BATCH_COMPLETED):
            webhooks.settle_batch_attempt(session, batch_id, attempt.number, webhooks.UNWANTED)
            return Delivery(state=webhooks.UNWANTED, attempt=attempt.number)
        body = encode(batch_payload(batch, batches.report(session, batch)))
        session.commit()  # no transaction stays open during the POST

        def record(posted: Posted, retry_at: datetime | None, at: datetime) -> str | None:
            state = webhooks.DELIVERED if posted.error is None else (
                webhooks.FAILED if retry_at is None else webhooks.PENDING)
            return webhooks.settle_batch_attempt(session, batch_id, attempt.number, state,
                                                 retry_at=retry_at)

        return _attempt(ctx, session, url=batch.webhook_url, owner_id=batch.owner_id,
                        msg_id=batch_event_id(batch_id), kind=webhooks.BATCH_COMPLETED, body=body,
                        number=attempt.number, now=now, record=record, batch_id=batch_id)


def deliver_live(ctx: Context, url: str, msg_id: str, kind: str, body: bytes, *,
                 attempt: int = 1) -> Delivery:
    """Attempt number ``attempt`` at a job.started or job.progress event, signed with the secrets
    of the owner of the job it is about (``data.id``): the POST alone, and the wait
    (``retry_in``) to the next attempt. `deliver_logged` and `redeliver_live` keep the outbox
    and the delivery log."""
    settings = ctx.settings
    job_id = json.loads(body)["data"]["id"]
    about = logs.fields(job=job_id)
    with ctx.sessions() as session:
        owner = webhook_secrets.ensure_for_job(session, job_id)
    if owner is None:  # the job is gone with its user: there is no one to sign for
        log.warning("webhook event %s: its job is gone; not sent", msg_id, extra=about)
        return Delivery(state="failed", attempt=attempt, error="the job is gone")
    posted = _post(settings, url, secrets=signing_secrets(settings, owner), msg_id=msg_id,
                   kind=kind, body=body, attempt=attempt, delivery_id=msg_id)
    if posted.error is None:
        # A job.progress event goes out every step or so: its line only at DEBUG.
        log.log(logging.DEBUG if kind == "job.progress" else logging.INFO,
                "webhook %s delivered to %s (HTTP %s, attempt %d)", kind, _destination(url),
                posted.status, attempt, extra=about)
        return Delivery(state="delivered", attempt=attempt, status=posted.status)
    retry_in = _retry_in(settings, attempt, posted)
    log.warning("webhook event %s, attempt %d: %s%s", msg_id, attempt, posted.error,
                "; giving up" if retry_in is None else f"; retrying in {retry_in:.0f} s",
                extra=about)
    return Delivery(state="failed" if retry_in is None else "pending", attempt=attempt,
                    status=posted.status, retry_in=retry_in, error=posted.error)


def _timed_live(ctx: Context, url: str, msg_id: str, kind: str, body: bytes, *, attempt: int,
                now: datetime) -> tuple[Delivery, datetime | None]:
    """`deliver_live` begun at ``now``, and the time of its retry when it is to be tried again
    (the wait counts from the end of this attempt)."""
    started = time.monotonic()
    outcome = deliver_live(ctx, url, msg_id, kind, body, attempt=attempt)
    if outcome.retry_in is None:
        return outcome, None
    return outcome, now + timedelta(seconds=time.monotonic() - started + outcome.retry_in)


def _log_live(session: Session, job_id: str, kind: str, msg_id: str, outcome: Delivery) -> None:
    _log(session, job_id=job_id, event=kind, msg_id=msg_id, attempt=outcome.attempt,
         status=outcome.status, error=outcome.error,
         outcome="retrying" if outcome.state == "pending" else outcome.state)


def deliver_logged(ctx: Context, url: str, msg_id: str, kind: str, body: bytes, *,
                   now: datetime | None = None) -> Delivery:
    """The first attempt at a job.started or job.progress event (`deliver_live`), in the
    delivery log under the job the event is about. One that is to be tried again is written to
    the outbox with its retry's time (`storage.webhooks.hold_live_retry`), where the sweeper
    finds it once due."""
    now = now or utcnow()
    outcome, retry_at = _timed_live(ctx, url, msg_id, kind, body, attempt=1, now=now)
    job_id = json.loads(body)["data"]["id"]
    with ctx.sessions() as session:
        if retry_at is not None:
            webhooks.hold_live_retry(session, msg_id=msg_id, job_id=job_id, url=url, event=kind,
                                     body=body.decode(), attempt=1, retry_at=retry_at, now=now)
        _log_live(session, job_id, kind, msg_id, outcome)
    return outcome


def redeliver_live(ctx: Context, msg_id: str, *, now: datetime | None = None) -> Delivery:
    """The next attempt at a job.started or job.progress event the outbox holds, if one is due
    (`storage.webhooks.begin_live_attempt`), logged like the first: its row then waits for the
    next retry, or goes once the event is delivered or given up."""
    now = now or utcnow()
    with ctx.sessions() as session:
        attempt = webhooks.begin_live_attempt(session, msg_id,
                                              hold_seconds=_hold_seconds(ctx.settings), now=now)
    if attempt is None:
        return Delivery(state="skipped")
    outcome, retry_at = _timed_live(ctx, attempt.url, msg_id, attempt.event,
                                    attempt.body.encode(), attempt=attempt.number, now=now)
    with ctx.sessions() as session:
        settled = webhooks.settle_live_attempt(session, msg_id, attempt.number,
                                               retry_at=retry_at)
        _log_live(session, attempt.job_id, attempt.event, msg_id, outcome)
    if not settled:  # a later attempt took over while this one overran its hold
        return replace(outcome, state="skipped", retry_in=None)
    return outcome


def sweep(ctx: Context, *, now: datetime | None = None, limit: int = 500) -> list[str]:
    """Ids of finished jobs whose webhook is owed and due: a retry whose time has come (or a
    died attempt's), or a first attempt whose task seems lost."""
    now = now or utcnow()
    with ctx.sessions() as session:
        return webhooks.owed(
            session, since=now - timedelta(hours=ctx.settings.webhook_sweep_hours), now=now,
            first_by=now - timedelta(seconds=SWEEP_GRACE_SECONDS), limit=limit)


def sweep_batches(ctx: Context, *, now: datetime | None = None, limit: int = 500) -> list[str]:
    """Ids of batches whose batch.completed is owed and due: a retry whose time has come (or a
    died attempt's), or a first attempt (or the decision that the batch is complete) whose task
    seems lost."""
    now = now or utcnow()
    with ctx.sessions() as session:
        return webhooks.owed_batches(
            session, now=now, first_by=now - timedelta(seconds=SWEEP_GRACE_SECONDS),
            limit=limit)


def sweep_live(ctx: Context, *, now: datetime | None = None,
               limit: int = 500) -> list[tuple[str, str]]:
    """The job.started and job.progress events whose retry is due: (job id, ``msg_id``)
    each."""
    with ctx.sessions() as session:
        return webhooks.owed_live(session, now=now or utcnow(), limit=limit)


def dispatch(ctx: Context, kind: str, ids: list[str]) -> list[str]:
    """Those of ``ids``, the sweeper's due deliveries of ``kind``, with no task of the sweeper's
    already on its way: each is marked in Redis until its task ends (`dispatched`), or for an
    attempt's hold should the task be lost. A queue that runs more than one sweep behind so gets
    one task per due delivery, not one per sweep; the outbox's lease keeps a delivery from being
    posted twice either way."""
    if not ids:
        return []
    hold = math.ceil(_hold_seconds(ctx.settings))
    with ctx.redis.pipeline(transaction=False) as pipe:
        for one in ids:
            pipe.set(_dispatch_key(ctx, kind, one), 1, nx=True, ex=hold)
        marked = pipe.execute()
    return [one for one, new in zip(ids, marked, strict=True) if new]


def dispatched(ctx: Context, kind: str, one: str) -> None:
    """The task for delivery ``one`` of ``kind`` has ended: the sweeper may enqueue its next
    attempt once due."""
    try:
        ctx.redis.delete(_dispatch_key(ctx, kind, one))
    except RedisError:  # the mark lapses with its hold
        log.warning("could not clear the dispatch mark of webhook %s %s", kind, one,
                    exc_info=True)


def _dispatch_key(ctx: Context, kind: str, one: str) -> str:
    return f"{ctx.settings.redis_prefix}webhook-dispatch:{kind}:{one}"


@dataclass(frozen=True, slots=True)
class Reaping:
    requeued: list[str]
    dead: list[str]
    cancelled: list[str]
    expired: list[str]
    notify: list[str]  # newly finished jobs that have a webhook_url
    # batches with a webhook whose last job was among the finished ones
    batches: list[str] = field(default_factory=list)


def reap_leases(ctx: Context, *, now: datetime | None = None) -> Reaping:
    """`storage.lifecycle.reap`, then `scheduler.attempts.settle`: the requeued jobs back into
    the queue index. The finished ones with a webhook are returned in ``notify`` (the task
    enqueues their deliveries)."""
    with ctx.sessions() as session:
        out = lifecycle.reap(session, now=now)
        settle(session, ctx.redis, ctx.settings.redis_prefix, requeued=out.requeued,
               finished=[])
        ended = out.dead + out.cancelled + out.expired
        notify = webhooks.has_webhook(session, ended)
        done = webhooks.completed_batches(session, ended)
    # A job that ends here had a rank that stopped answering: its checkpoint is not wanted.
    for job_id in out.dead + out.cancelled:
        try:
            ctx.store.delete(checkpoint_key(job_id))
        except OSError as exc:  # best effort: it is left in the store, and said so
            log.warning("job %s's checkpoint not deleted: %s", job_id, exc)
    return Reaping(requeued=[j.id for j in out.requeued], dead=out.dead,
                   cancelled=out.cancelled, expired=out.expired, notify=notify, batches=done)


def reconcile(ctx: Context) -> queue_index.Reconciled:
    """The Redis queue index from the database (`scheduler.queue_index.reconcile`)."""
    with ctx.sessions() as session:
        return queue_index.reconcile(session, ctx.redis, ctx.settings.redis_prefix)


def clean_up(ctx: Context, *, now: datetime | None = None) -> list[str]:
    """Deletes the outputs of jobs finished more than ``retention_days`` ago and marks their rows
    purged; returns their ids. ``retention_days = 0`` keeps everything."""
    days = ctx.settings.retention_days
    if days == 0:
        return []
    now = now or utcnow()
    cutoff = now - timedelta(days=days)
    purged: list[str] = []
    while True:
        with ctx.sessions() as session:
            found = retention.expired_outputs(session, finished_before=cutoff,
                                              limit=_CLEAN_UP_CHUNK)
            for outputs in found:
                for key in outputs.keys:  # objects first: see storage.retention
                    ctx.store.delete(key)
                if retention.mark_purged(session, outputs, now=now):
                    purged.append(outputs.job_id)
        if len(found) < _CLEAN_UP_CHUNK:
            return purged


def clean_up_checkpoints(ctx: Context) -> list[str]:
    """Deletes the checkpoints no attempt will resume: those of jobs that are over (ended where
    no rank deleted the checkpoint: dead after a crash, cancelled while queued) or no longer
    there; returns their job ids. A queued or running job's checkpoint stays."""
    held = {key.removeprefix("checkpoints/").removesuffix(".ckpt"): key
            for key in ctx.store.keys("checkpoints")}
    if not held:
        return []
    with ctx.sessions() as session:
        alive = queries.unfinished_job_ids(session, list(held))
    gone = sorted(set(held) - alive)
    for job_id in gone:
        ctx.store.delete(held[job_id])
    return gone


def clean_up_inputs(ctx: Context, *, now: datetime | None = None) -> list[str]:
    """Deletes the input files uploaded more than ``retention_days`` ago, each object before its
    row (see storage.retention); returns their ids. ``retention_days = 0`` keeps everything."""
    days = ctx.settings.retention_days
    if days == 0:
        return []
    cutoff = (now or utcnow()) - timedelta(days=days)
    deleted: list[str] = []
    while True:
        with ctx.sessions() as session:
            found = retention.expired_inputs(session, created_before=cutoff,
                                             limit=_CLEAN_UP_CHUNK)
            for file_id, key in found:
                ctx.store.delete(key)
                if input_files.forget_input_file(session, file_id):
                    deleted.append(file_id)
        if len(found) < _CLEAN_UP_CHUNK:
            return deleted


# ---- the Celery app and its tasks ---------------------------------------------------------------

def make_celery(settings: Settings) -> Celery:
    """A Celery app on ``settings``' Redis with kiln's tasks, which work against ``settings``'
    servers. Every process that runs or enqueues the side work builds its own from its settings:
    `kiln celery` (worker and beat), the worker group's rank 0 (its webhooks), Celery's own
    command line (`kiln.celery_app`), the tests. An app is never reconfigured: other settings
    make another app, with its own connections (close it with ``app.close()``)."""
    app = Celery("kiln", set_as_current=False)
    app.conf.update(celery_config(settings))

    @cache
    def context() -> Context:
        # Built on first use: in a prefork pool each child makes its own connections after the
        # fork.
        return make_context(settings)

    # Each task is this app's alone (shared=False): Celery's default would add it to every app
    # built later in the process, with this app's settings. The periodic ones keep no result:
    # beat starts thousands a day and nobody reads them (the worker log has their counts). The
    # delivery tasks make one attempt each and end: a retry is due by its outbox row, and the
    # sweeper enqueues it (webhook_max_attempts, counted there, decides when they stop).

    @app.task(name="kiln.deliver_webhook", shared=False)
    def deliver_webhook(job_id: str) -> dict[str, Any]:
        ctx = context()
        try:
            outcome = deliver(ctx, job_id)
        finally:
            dispatched(ctx, "job", job_id)
        return {"state": outcome.state, "attempt": outcome.attempt, "status": outcome.status}

    @app.task(name="kiln.deliver_batch_webhook", shared=False)
    def deliver_batch_webhook(batch_id: str) -> dict[str, Any]:
        ctx = context()
        try:
            outcome = deliver_batch(ctx, batch_id)
        finally:
            dispatched(ctx, "batch", batch_id)
        return {"state": outcome.state, "attempt": outcome.attempt, "status": outcome.status}

    @app.task(name="kiln.deliver_event", shared=False, ignore_result=True)
    def deliver_event(url: str, msg_id: str, kind: str, body: str) -> str:
        return deliver_logged(context(), url, msg_id, kind, body.encode()).state

    @app.task(name="kiln.retry_event", shared=False, ignore_result=True)
    def retry_event(job_id: str, msg_id: str) -> str:
        # job_id is for the log lines (_ABOUT); the outbox row has all the event.
        ctx = context()
        try:
            return redeliver_live(ctx, msg_id).state
        finally:
            dispatched(ctx, "event", msg_id)

    @app.task(name="kiln.sweep_webhooks", shared=False, ignore_result=True)
    def sweep_webhooks() -> int:
        ctx = context()
        jobs = dispatch(ctx, "job", sweep(ctx))
        for job_id in jobs:
            deliver_webhook.delay(job_id)
        batches = dispatch(ctx, "batch", sweep_batches(ctx))
        for batch_id in batches:
            deliver_batch_webhook.delay(batch_id)
        live = {msg_id: job_id for job_id, msg_id in sweep_live(ctx)}
        events = dispatch(ctx, "event", list(live))
        for msg_id in events:
            retry_event.delay(live[msg_id], msg_id)
        return len(jobs) + len(batches) + len(events)

    @app.task(name="kiln.reap_leases", shared=False, ignore_result=True)
    def reap_leases_task() -> dict[str, int]:
        out = reap_leases(context())
        for job_id in out.notify:
            deliver_webhook.delay(job_id)
        for batch_id in out.batches:
            deliver_batch_webhook.delay(batch_id)
        return {"requeued": len(out.requeued), "dead": len(out.dead),
                "cancelled": len(out.cancelled), "expired": len(out.expired)}

    @app.task(name="kiln.reconcile_ready_index", shared=False, ignore_result=True)
    def reconcile_ready_index() -> dict[str, int]:
        out = reconcile(context())
        return {"added": out.added, "removed": out.removed}

    @app.task(name="kiln.clean_up_outputs", shared=False, ignore_result=True)
    def clean_up_outputs() -> int:
        ctx = context()
        return len(clean_up(ctx)) + len(clean_up_checkpoints(ctx)) + len(clean_up_inputs(ctx))

    return app


def enqueue_job_finished(app: Celery, session: Session, job_id: str) -> bool:
    """Asks ``app`` for the webhook of a job that just reached a final state (call after the
    commit), and for its batch's batch.completed when it was the batch's last job.

    Best effort: the sweeper delivers anyway, so no error here (Redis down, no broker configured)
    may disturb the caller. True if a task was enqueued.
    """
    try:
        if app.conf.broker_url is None:
            return False
        jobs = webhooks.has_webhook(session, [job_id])
        batches = webhooks.completed_batches(session, [job_id])
        if not jobs and not batches:
            return False
        with app.connection_for_write() as conn:
            # One try, no waiting between retries: a worker group must not stall on Redis.
            conn.ensure_connection(max_retries=0, interval_start=0, timeout=5)
            for one in jobs:
                app.tasks["kiln.deliver_webhook"].apply_async((one,), connection=conn,
                                                              retry=False)
            for batch_id in batches:
                app.tasks["kiln.deliver_batch_webhook"].apply_async((batch_id,), connection=conn,
                                                                    retry=False)
        return True
    except Exception:  # any failure: broker, network, database; the sweeper is the safety net
        log.warning("could not enqueue the webhook of job %s; the sweeper will send it", job_id,
                    exc_info=True)
        # A failed read leaves the caller's session in a failed transaction; the caller's own
        # work was committed before this call, so rolling back loses nothing.
        with contextlib.suppress(Exception):
            session.rollback()
        return False


def enqueue_event(app: Celery, url: str, msg_id: str, kind: str, body: bytes) -> bool:
    """Asks ``app`` for a job.started or job.progress event (`deliver_live`). Best effort like
    `enqueue_job_finished`: never raises, never waits on Redis; True if a task was enqueued."""
    try:
        if app.conf.broker_url is None:
            return False
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=0, interval_start=0, timeout=5)
            app.tasks["kiln.deliver_event"].apply_async((url, msg_id, kind, body.decode()),
                                                        connection=conn, retry=False)
        return True
    except Exception:
        log.warning("could not enqueue the webhook event %s", msg_id, exc_info=True)
        return False
