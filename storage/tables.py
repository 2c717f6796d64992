"""SQLAlchemy tables: users with their API keys and webhook secrets, jobs, batches, worker
groups, job events, uploaded input files, LoRA adapters.

The schema is created and changed only by the Alembic revisions in ``migrations/``; these classes
are what the code reads and writes, and a test checks that the two agree.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints so that migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_ID_LENGTH = 20


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    PostgreSQL keeps ``timestamptz``; SQLite has no time zones, so values are stored as naive UTC
    (which keeps its text comparisons in lease and deadline queries correct) and come back aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # gave a reason a person can act on; not retried
    CANCELLED = "cancelled"
    DEAD = "dead"  # lost its worker (or failed retryably) max_attempts times
    EXPIRED = "expired"  # its deadline passed before it could start


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.DEAD, JobState.EXPIRED}
)


class JobClass(enum.StrEnum):
    INTERACTIVE = "interactive"  # someone waits for it: always before batch work
    BATCH = "batch"  # overnight bulk work


# A job's priority orders it within its class: higher runs first.
MIN_PRIORITY = 0
MAX_PRIORITY = 9
DEFAULT_PRIORITY = 5
MAX_SEED = 2**63 - 1  # seeds fit the BIGINT column


def _in(values: type[enum.StrEnum]) -> str:
    return ", ".join(f"'{v.value}'" for v in values)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


# SQLite only auto-increments INTEGER PRIMARY KEY, not BIGINT.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """A bearer key. Only its SHA-256 is kept; ``prefix`` is the visible part used for lookup."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class WebhookSecret(Base):
    """A user's webhook signing secret, ``whsec_<base64 of 32 random bytes>``
    (`storage.webhook_secrets`). Kept as it is, not hashed: kiln signs with it. After a rotation
    the replaced secret still signs, beside the new one, until ``previous_until``."""

    __tablename__ = "webhook_secrets"

    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
    )
    secret: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)  # of the current secret
    previous_secret: Mapped[str | None] = mapped_column(String(64))
    previous_until: Mapped[datetime | None]


class Batch(Base):
    """A named group of jobs submitted together (an overnight prompt list)."""

    __tablename__ = "batches"
    __table_args__ = (
        # Same key twice from one user is the same batch; NULL keys never collide.
        Index("uq_batches_owner_idempotency_key", "owner_id", "idempotency_key", unique=True),
        # Listing one user's batches newest first, with a keyset cursor.
        Index("ix_batches_owner_created", "owner_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(JOB_ID_LENGTH), primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    # The window given at submission, copied onto every job of the batch.
    not_before: Mapped[datetime | None]
    deadline: Mapped[datetime | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # batch.completed, POSTed once its last job has ended (`storage.webhooks`). The batch row is
    # that event's outbox: ``webhook_state`` goes from NULL to "pending" in one guarded UPDATE
    # when its jobs are all final, then to delivered | failed | unwanted.
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    webhook_events: Mapped[list[str] | None] = mapped_column(JSON)  # None: batch.completed
    webhook_state: Mapped[str | None] = mapped_column(String(16))
    webhook_attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    # As `WebhookDelivery.next_attempt_at`: the next attempt's time, or a running one's hold.
    webhook_next_attempt_at: Mapped[datetime | None]


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"state IN ({_in(JobState)})", name="state"),
        CheckConstraint(f"job_class IN ({_in(JobClass)})", name="job_class"),
        # Same key twice from one user is the same request; NULL keys never collide.
        UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        # Listing one user's jobs newest first, with a keyset cursor.
        Index("ix_jobs_owner_created", "owner_id", "created_at", "id"),
        # Counting a user's queued jobs (the per-user limit) and rebuilding the queue index.
        Index("ix_jobs_owner_state", "owner_id", "state"),
        Index("ix_jobs_state_order", "state", "job_class", "priority", "created_at"),
        # The reaper: running jobs whose lease ran out.
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
    )

    id: Mapped[str] = mapped_column(String(JOB_ID_LENGTH), primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    batch_id: Mapped[str | None] = mapped_column(
        ForeignKey("batches.id", ondelete="SET NULL"), index=True
    )
    batch_index: Mapped[int | None]  # 1-based line of the batch submission it came from

    # The request, as validated by the API.
    model: Mapped[str] = mapped_column(String(100))
    prompt: Mapped[str] = mapped_column(Text)
    negative_prompt: Mapped[str | None] = mapped_column(Text)
    width: Mapped[int]
    height: Mapped[int]
    num_frames: Mapped[int]
    fps: Mapped[int]
    num_inference_steps: Mapped[int]
    guidance_scale: Mapped[float] = mapped_column(Float)
    seed: Mapped[int] = mapped_column(BigInteger)  # drawn at submit when not given: re-runs match
    class_: Mapped[str] = mapped_column("job_class", String(16), default=JobClass.INTERACTIVE.value)
    priority: Mapped[int] = mapped_column(default=DEFAULT_PRIORITY)  # higher runs first in a class
    not_before: Mapped[datetime | None]
    deadline: Mapped[datetime | None]
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    # The webhook events asked for (`storage.webhooks.EVENTS`); None: the final ones only.
    webhook_events: Mapped[list[str] | None] = mapped_column(JSON)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))

    # Lifecycle; every change goes through a guarded UPDATE in storage.lifecycle.
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED.value)
    attempts: Mapped[int] = mapped_column(default=0)  # attempts started (claims)
    # Of those, the ones handed back without charge: the job did not cause their end (a
    # graceful stop, a drain). ``max_attempts`` bounds the charged ones, attempts - these.
    uncharged_attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    max_attempts: Mapped[int] = mapped_column(default=3)
    attempt_token: Mapped[str | None] = mapped_column(String(32))
    lease_expires_at: Mapped[datetime | None]
    worker_group_id: Mapped[str | None] = mapped_column(String(64))
    rank: Mapped[int | None]
    progress_step: Mapped[int] = mapped_column(default=0)
    progress_total: Mapped[int] = mapped_column(default=0)
    # The step the current (or last) attempt resumed from, a checkpoint of an earlier attempt's
    # denoising state; None: it started at step 0. Each claim clears it (`storage.lifecycle`).
    resumed_from_step: Mapped[int | None]
    # How many times the job was suspended in place on its replica for an interactive job.
    preemptions: Mapped[int] = mapped_column(default=0, server_default="0")
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(String(32))

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]  # start of the latest attempt
    finished_at: Mapped[datetime | None]
    render_seconds: Mapped[float | None] = mapped_column(Float)  # of the successful attempt
    # What the successful attempt's steps cost its replica: the block gathers it took part in
    # (0 where no weights are gathered), and the blocks it computed where a step cache counts
    # them (None where none does; fewer than blocks x forwards when the cache skipped some).
    gathers: Mapped[int | None]
    blocks_computed: Mapped[int | None]
    deleted_at: Mapped[datetime | None]  # hidden from users; the row stays for accounting

    output_video_key: Mapped[str | None] = mapped_column(String(255))
    output_thumbnail_key: Mapped[str | None] = mapped_column(String(255))

    # What the render starts from besides its text: an upload (`InputFile`) of its owner, fitted
    # to the job's size by ``input_fit`` ("crop", "pad", "stretch"); None: text only. A file
    # deleted before the job runs leaves the id None and the job fails when claimed.
    input_file_id: Mapped[str | None] = mapped_column(
        String(JOB_ID_LENGTH), ForeignKey("input_files.id", ondelete="SET NULL"))
    input_fit: Mapped[str | None] = mapped_column(String(8))
    # "extend": the input is a video whose last frame the render starts from, and the stored
    # video is that video followed by the new frames; None: the input conditions the render.
    input_role: Mapped[str | None] = mapped_column(String(8))
    # The job whose video this one was made from (a remix, an edit or an extension of it).
    source_job_id: Mapped[str | None] = mapped_column(String(JOB_ID_LENGTH))
    strength: Mapped[float | None] = mapped_column(Float)  # video-to-video; None: the family's
    # The soundtrack: asked for (None: the model's default, on where it makes sound) and
    # written (None until the video is).
    audio: Mapped[bool | None] = mapped_column(Boolean)
    has_audio: Mapped[bool | None] = mapped_column(Boolean)
    # LoRA adapters (`LoraAdapter`) the render applies: [{"id", "scale"}], in the order given;
    # None: none. Checked at the door; one deleted before the job runs fails it when claimed.
    adapters: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # The quality tier (`common.quality`): "exact", "balanced", "fast"; None: exact.
    quality: Mapped[str | None] = mapped_column(String(8))


class WorkerGroup(Base):
    """A persistent torch.distributed worker group, as it last reported itself."""

    __tablename__ = "worker_groups"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(100))
    mode: Mapped[str] = mapped_column(String(32))  # "allgather" | "rank_local"
    # "latency" (interactive jobs first) | "throughput" (batch jobs first); None: a group that
    # reported none (before goals)
    goal: Mapped[str | None] = mapped_column(String(32))
    # `kiln worker --layout auto`: the layout chosen and the runner-up, with their predicted
    # figures (runtime.planner); None when the layout was given.
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    platform: Mapped[str] = mapped_column(String(32))  # "cuda" | "npu" | "cpu"
    dp_size: Mapped[int]
    world_size: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), default="starting")
    state_reason: Mapped[str | None] = mapped_column(String(500))  # why, when "degraded"
    # One entry per rank: {"rank", "device", "device_mem_used_bytes", "device_mem_total_bytes",
    # "host_mem_bytes", "job_id"}; replaced whole at every report.
    ranks: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobEvent(Base):
    """Append-only history of a job: one row per state change, written with the change."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    attempt: Mapped[int] = mapped_column(default=0)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class WebhookDelivery(Base):
    """The delivery record of a finished job's webhook (`storage.webhooks`).

    The job row itself is the outbox: a job in a final state with a ``webhook_url`` and no
    ``delivered``/``failed`` row here still owes its webhook, whatever happened to the task.
    """

    __tablename__ = "webhook_deliveries"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    # pending | delivered | failed | unwanted (the job did not ask for its final event)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    # Not before this may the next attempt start; while an attempt runs, the end of its hold.
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_status: Mapped[int | None]  # HTTP status of the latest attempt (None: no response)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class WebhookAttempt(Base):
    """The delivery log: one row per attempt at a webhook event, a job's or a batch's, with how
    it went. Written after the attempt; the outbox state lives in `WebhookDelivery` and on
    `Batch`, so a lost row here loses a line of history, never a delivery."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (
        Index("ix_webhook_attempts_job_id_id", "job_id", "id"),
        Index("ix_webhook_attempts_batch_id_id", "batch_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))  # job.succeeded, batch.completed, ...
    msg_id: Mapped[str] = mapped_column(String(100))  # its webhook-id
    attempt: Mapped[int]  # 1 for the first
    at: Mapped[datetime] = mapped_column(default=utcnow)  # when it ended
    status: Mapped[int | None]  # the receiver's HTTP status; None: no answer (or not sent)
    error: Mapped[str | None] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(String(16))  # delivered | retrying | failed


class LiveWebhookRetry(Base):
    """A job.started or job.progress event owed another attempt (`storage.webhooks`): written
    when an attempt failed and is to be tried again, deleted once the event is delivered or given
    up. Final events have their outbox in `WebhookDelivery`; the delivery log keeps every
    attempt."""

    __tablename__ = "live_webhook_retries"
    __table_args__ = (Index("ix_live_webhook_retries_next_attempt_at", "next_attempt_at"),)

    msg_id: Mapped[str] = mapped_column(String(100), primary_key=True)  # its webhook-id
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    event: Mapped[str] = mapped_column(String(32))  # job.started | job.progress
    body: Mapped[str] = mapped_column(Text)  # the event's JSON, as every attempt sends it
    attempts: Mapped[int]  # made so far
    # Not before this may the next attempt start; while an attempt runs, the end of its hold.
    next_attempt_at: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# The webhook sweeper (recently finished jobs) and retention (long-finished jobs) both range over
# finished_at.
Index("ix_jobs_finished_at", Job.finished_at)


class InputFile(Base):
    """An uploaded input, an image or a video, that requests reference by id. It was decoded and
    checked (`storage.media`) before its bytes went to the output store under ``storage_key`` and
    this row was written; what it is (kind, content type, size) comes from its content."""

    __tablename__ = "input_files"
    __table_args__ = (
        CheckConstraint("kind IN ('image', 'video')", name="kind"),
        # Listing one user's files newest first, and retention's oldest first.
        Index("ix_input_files_owner_created", "owner_id", "created_at", "id"),
        Index("ix_input_files_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(JOB_ID_LENGTH), primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    purpose: Mapped[str] = mapped_column(String(16))  # as the upload said (`api.schemas`)
    content_type: Mapped[str] = mapped_column(String(32))
    # The client's name for it, shown back to its owner; never part of a path.
    filename: Mapped[str | None] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    width: Mapped[int]  # after EXIF orientation
    height: Mapped[int]
    num_frames: Mapped[int]  # 1 for an image
    duration_seconds: Mapped[float | None] = mapped_column(Float)  # None for an image
    storage_key: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LoraAdapter(Base):
    """A registered LoRA adapter for one model: a diffusers-format ``.safetensors`` file checked
    against the model's transformer modules and shapes when it was registered
    (`storage.adapters`). Its bytes live in the output store under a key made of their sha256,
    so two registrations of one file share the object. ``owner_id`` None: shared by an admin
    with every user."""

    __tablename__ = "adapters"
    __table_args__ = (
        # A name is unique among one user's adapters, and among the shared ones.
        Index("uq_adapters_owner_name", "owner_id", "name", unique=True,
              postgresql_where=text("owner_id IS NOT NULL"),
              sqlite_where=text("owner_id IS NOT NULL")),
        Index("uq_adapters_shared_name", "name", unique=True,
              postgresql_where=text("owner_id IS NULL"), sqlite_where=text("owner_id IS NULL")),
        Index("ix_adapters_sha256", "sha256"),
    )

    id: Mapped[str] = mapped_column(String(JOB_ID_LENGTH), primary_key=True)
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(String(100))  # the model it was checked against
    family: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int]  # the largest rank of its layers
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # the file's
    sha256: Mapped[str] = mapped_column(String(64))  # of the file's bytes
    storage_key: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
