"""What the routes share: turning requests into checked job specs, submitting (row first, Redis
after the commit), and rendering rows as native jobs or OpenAI videos."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from fastapi import HTTPException, status
from fastapi.exceptions import RequestValidationError
from redis import Redis, RedisError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.schemas import (
    JobCreate,
    JobError,
    JobPublic,
    VideoCreate,
    VideoError,
    VideoPublic,
    VideoStatus,
    metadata_bytes,
)
from common import admission, logs, netguard
from common.families import GENERIC, family_of
from common.quality import tier_threshold
from common.render import RequestDefaults
from common.settings import Settings
from scheduler import queue_index
from storage import batches, idempotency, submission
from storage.submission import Created, JobSpec
from storage.tables import Job, JobClass, JobState, User, utcnow

if TYPE_CHECKING:
    from storage.media import FitMode  # typing only: the module loads av and PIL

log = logging.getLogger(__name__)


class _Problems:
    """Collects the refusals of a request so one 422 lists all of them, each naming its field:
    the render rules of `common.admission`, and the door's own (schedule, webhook, metadata)."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def add(self, field: str | None, message: str) -> None:
        """``field`` None: the request as a whole (a bound on several fields at once)."""
        loc = ("body",) if field is None else ("body", field)
        self.errors.append({"loc": loc, "msg": message, "type": "limit"})

    def extend(self, problems: list[admission.Problem]) -> None:
        for problem in problems:
            self.add(problem.field, problem.message)

    def raise_if_any(self) -> None:
        if self.errors:
            raise RequestValidationError(self.errors)


def _check_common(p: _Problems, s: Settings, spec: JobSpec, now: datetime,
                  size_fields: tuple[str, str] = ("width", "height"),
                  frames_field: str = "num_frames") -> None:
    p.extend(admission.request_problems(s, spec, model=spec.model, size_fields=size_fields,
                                        frames_field=frames_field))
    horizon = now + timedelta(days=s.max_schedule_days)
    if spec.not_before is not None:
        if spec.not_before > horizon:
            p.add("not_before", f"at most {s.max_schedule_days} days ahead")
        elif spec.not_before < now - timedelta(days=s.max_schedule_days):
            p.add("not_before", f"at most {s.max_schedule_days} days in the past")
    if spec.deadline is not None:
        if spec.deadline <= now:
            p.add("deadline", "is already in the past")
        elif spec.deadline > horizon:
            p.add("deadline", f"at most {s.max_schedule_days} days ahead")
        elif spec.not_before is not None and spec.deadline <= spec.not_before:
            p.add("deadline", "must be after not_before")
    # Literal addresses only; names are resolved and checked again when the webhook is sent.
    if spec.webhook_url is not None:
        reason = netguard.submit_refusal(spec.webhook_url,
                                         private_allowed=netguard.private_allowed(s))
        if reason is not None:
            p.add("webhook_url", reason)


def request_defaults(s: Settings, model: str) -> RequestDefaults:
    """What a request for ``model`` gets for the fields it leaves out: its family's defaults
    (`common.families`), with any ``KILN_DEFAULT_*`` setting on top."""
    # Only a model this API serves is looked up: the name may be a directory on this machine.
    own = (family_of(model) if model in s.models else GENERIC).defaults
    overrides = {f.name: getattr(s, f"default_{f.name}") for f in dataclasses.fields(own)
                 if getattr(s, f"default_{f.name}") is not None}
    return dataclasses.replace(own, **overrides) if overrides else own


#: The kind ("image", "video") of the caller's upload of that id; None: no such file of theirs.
InputKinds = Callable[[str], str | None]


def no_inputs(file_id: str) -> str | None:
    return None


def check_input(p: _Problems, s: Settings, spec: JobSpec, kind_of: InputKinds, *,
                field: str = "input_file_id") -> None:
    """The request's input file against its model: the caller's own upload, of a kind the
    model conditions on; a model that renders only from an input refuses a request without."""
    if spec.model not in s.models:
        return  # already refused, and GENERIC takes nothing
    kind = None
    if spec.input_file_id is not None:
        kind = kind_of(spec.input_file_id)
        if kind is None:
            p.add(field, "file not found: give the id of an upload of yours (POST /v1/files)")
            return
    able = admission.models_taking(s, kind) if kind else []
    p.extend(admission.input_problems(admission.family_for(s, spec.model), kind, field=field,
                                      fit=spec.input_fit, strength=spec.strength, able=able))


#: The model of the caller's (or a shared) adapter of that id; None: no such adapter for them.
AdapterModels = Callable[[str], str | None]


def no_adapters(adapter_id: str) -> str | None:
    return None


def check_adapters(p: _Problems, spec: JobSpec, model_of: AdapterModels) -> None:
    """Each adapter the request names is one the caller may use (their own or a shared one),
    registered for the request's model, and named once: a deleted or foreign id is refused
    here, at the door, rather than failing on a rank."""
    seen: set[str] = set()
    for i, item in enumerate(spec.adapters or ()):
        field, adapter_id = f"adapters.{i}.id", item["id"]
        model = model_of(adapter_id)
        if model is None:
            p.add(field, "adapter not found: give the id of an adapter of yours or a shared "
                         "one (GET /v1/adapters)")
        elif model != spec.model:
            p.add(field, f"the adapter is for {model}, not {spec.model}")
        elif adapter_id in seen:
            p.add(field, "the same adapter is named twice")
        seen.add(adapter_id)


def spec_from_job_create(body: JobCreate, s: Settings, now: datetime,
                         kind_of: InputKinds = no_inputs,
                         adapter_model: AdapterModels = no_adapters) -> JobSpec:
    """``kind_of``: looks up the caller's uploads, for ``input_file_id``; ``adapter_model``:
    the adapters they may use, for ``adapters``."""
    model = body.model or s.default_model
    d = request_defaults(s, model)
    given = {f.name: getattr(body, f.name) for f in dataclasses.fields(d)}
    spec = JobSpec(
        model=model,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        **{name: getattr(d, name) if value is None else value for name, value in given.items()},
        seed=body.seed,
        job_class=JobClass(body.job_class),
        priority=body.priority,
        not_before=body.not_before,
        deadline=body.deadline,
        webhook_url=str(body.webhook_url) if body.webhook_url is not None else None,
        webhook_events=(sorted(set(body.webhook_events))
                        if body.webhook_events is not None else None),
        metadata=dict(body.metadata),
        input_file_id=body.input_file_id,
        input_fit=body.fit or ("crop" if body.input_file_id is not None else None),
        strength=body.strength,
        audio=body.audio,
        adapters=([{"id": a.id, "scale": a.scale} for a in body.adapters]
                  if body.adapters else None),
        quality=body.quality if body.quality not in (None, "exact") else None,
    )
    p = _Problems()
    _check_common(p, s, spec, now)
    check_input(p, s, spec, kind_of)
    check_adapters(p, spec, adapter_model)
    if spec.quality is not None and spec.model in s.models:
        try:
            tier_threshold(admission.family_for(s, spec.model).name, spec.quality)
        except ValueError as exc:
            p.add("quality", str(exc))
    if metadata_bytes(spec.metadata) > s.max_metadata_bytes:
        p.add("metadata", f"at most {s.max_metadata_bytes} bytes as JSON")
    p.raise_if_any()
    return spec


def spec_from_video_create(body: VideoCreate, s: Settings, now: datetime) -> JobSpec:
    p = _Problems()
    # The OpenAI SDK defaults to its own model names; those mean "the default model" here.
    model = body.model if body.model in s.models else s.default_model
    if body.model is not None and body.model not in s.models and not body.model.startswith(
        "sora"
    ):
        p.add("model", f"unknown model {body.model!r}; available: {', '.join(s.models)}")
    d = request_defaults(s, model)
    width, height = d.width, d.height
    if body.size is not None:
        w, h = body.size.split("x")
        width, height = int(w), int(h)
    fps = body.fps or d.fps
    num_frames = d.num_frames
    if body.seconds is not None:
        seconds = int(body.seconds)
        if seconds < 1:
            p.add("seconds", "must be at least 1")
        # Wan's convention: N seconds at F fps is 1 + N*F frames (5 s at 16 fps: 81), rounded
        # up to the model's frame rule (its VAE's stride and the deployment's; MiniMax-H3's
        # 5 + 17k: 5 s at 24 fps is 124), so the count is one the model renders.
        family = admission.family_for(s, model)
        stride, base = admission.frame_stride(s, family), family.frame_base
        wanted = 1 + seconds * fps
        num_frames = max(family.min_frames, base + -(-(wanted - base) // stride) * stride)
    spec = JobSpec(
        model=model, prompt=body.prompt, negative_prompt=body.negative_prompt, width=width,
        height=height, num_frames=num_frames, fps=fps,
        num_inference_steps=body.num_inference_steps or d.num_inference_steps,
        guidance_scale=(body.guidance_scale if body.guidance_scale is not None
                        else d.guidance_scale),
        seed=body.seed,
    )
    _check_common(p, s, spec, now, size_fields=("size", "size"), frames_field="seconds")
    p.raise_if_any()
    return spec


def request_hash(kind: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({"kind": kind, "body": body}, sort_keys=True, separators=(",", ":"),
                           default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class QueueRoom:
    """Decides which submits count the user's queued jobs against the per-user limit.

    The count is a database scan of the user's queued jobs (up to the limit) on the API's
    hottest path. The limit guards against runaway clients and need not be exact, so after a
    count this process lets the user's next submits skip it while they cannot matter: for
    ``recount_seconds``, and for at most a quarter of the room that count left, so that a few
    API processes skipping at once still stay under the limit. Near the limit every submit
    counts.
    """

    def __init__(self, recount_seconds: float = 1.0, max_users: int = 100_000) -> None:
        self.recount_seconds = recount_seconds
        self.max_users = max_users
        self._skips: dict[int, tuple[float, float]] = {}  # user id -> (counted at, skips left)
        self._lock = threading.Lock()

    def must_count(self, user_id: int) -> bool:
        with self._lock:
            entry = self._skips.get(user_id)
            if (entry is None or entry[1] < 1
                    or time.monotonic() - entry[0] > self.recount_seconds):
                return True
            self._skips[user_id] = (entry[0], entry[1] - 1)
            return False

    def counted(self, user_id: int, queued_before: int, limit: int) -> None:
        with self._lock:
            if len(self._skips) >= self.max_users:
                self._skips.clear()  # bounded; the next submits count again
            room = limit - queued_before - 1  # after the job just added
            self._skips[user_id] = (time.monotonic(), room / 4)


def submit(
    session: Session, redis: Redis, s: Settings, user: User, spec: JobSpec, *,
    request_hash: str, idempotency_key: str | None, room: QueueRoom | None = None,
) -> tuple[Created, int | None]:
    """Stores the job, commits, and only then adds it to the Redis queue index. Returns the
    job and, for a new one, its queue position (None when Redis could not say). ``room``: when
    to count the user's queued jobs (None: every time)."""
    count = room is None or room.must_count(user.id)
    with creation_errors_as_http(s):
        created = submission.create_job(
            session, user, spec, request_hash=request_hash, idempotency_key=idempotency_key,
            max_attempts=s.max_attempts, max_queued=s.max_queued_jobs_per_user if count else None,
        )
    if room is not None and created.queued_before is not None:
        room.counted(user.id, created.queued_before, s.max_queued_jobs_per_user)
    if not created.created:
        return created, None
    log.info("submitted by %s: model %s, %d steps", user.name, created.job.model,
             created.job.num_inference_steps, extra=logs.fields(job=created.job.id))
    try:
        return created, queue_index.add_one(redis, s.redis_prefix, created.job)
    except RedisError:
        _not_indexed([created.job])
        return created, None


def dispatch(redis: Redis, s: Settings, new_jobs: list[Job]) -> None:
    """Adds committed queued jobs to the Redis queue index (call only after the commit)."""
    if not new_jobs:
        return
    try:
        queue_index.add(redis, s.redis_prefix, new_jobs)
    except RedisError:
        _not_indexed(new_jobs)


def _not_indexed(new_jobs: list[Job]) -> None:
    # The rows are committed, so the jobs are safe; the periodic rebuild indexes them.
    log.warning("Redis unavailable; %d job(s) (%s, ...) wait for the next index rebuild",
                len(new_jobs), new_jobs[0].id, exc_info=True)


def owner_filter(session: Session, user: User, owner: str | None, what: str) -> int | None:
    """The owner id a list's ``owner`` query asks for: None for no filter, -1 for an unknown
    name (an empty page); only admins may name another user."""
    if owner is None:
        return None
    if not user.is_admin and owner != user.name:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"owner: only admins may list other users' {what}")
    found = session.scalar(select(User.id).where(User.name == owner))
    return found if found is not None else -1


@contextlib.contextmanager
def creation_errors_as_http(s: Settings) -> Iterator[None]:
    """What creating jobs can refuse, as the HTTP answers the API gives for it."""
    try:
        yield
    except idempotency.IdempotencyConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except submission.QueueFull as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc),
                            headers={"Retry-After": str(s.queue_full_retry_after_seconds)}
                            ) from exc


def unindex(redis: Redis, s: Settings, job: Job) -> None:
    try:
        queue_index.remove(redis, s.redis_prefix, [job.id])
    except RedisError:
        # A stale entry is harmless: the batcher's claim refuses a job that is not queued.
        log.warning("Redis unavailable; stale queue index entry for %s left behind", job.id)


def _error(job: Job) -> JobError | None:
    error = batches.job_error(job)
    return JobError(code=error.code, message=error.message) if error is not None else None


def job_public(job: Job, *, queue_position: int | None = None,
               owner: str | None = None) -> JobPublic:
    # The step count (num_inference_steps) as the progress report recorded it: the row's
    # progress_total column, public as total_steps.
    total = job.progress_total or job.num_inference_steps
    step = total if job.state == JobState.SUCCEEDED else min(job.progress_step, total)
    return JobPublic(
        id=job.id, status=job.state, owner=owner, model=job.model, prompt=job.prompt,
        negative_prompt=job.negative_prompt, width=job.width, height=job.height,
        num_frames=job.num_frames, fps=job.fps, num_inference_steps=job.num_inference_steps,
        guidance_scale=job.guidance_scale, seed=job.seed, job_class=job.class_,
        priority=job.priority, not_before=job.not_before, deadline=job.deadline,
        webhook_url=job.webhook_url, webhook_events=job.webhook_events, metadata=job.meta,
        batch_id=job.batch_id,
        progress=round(step / total, 4) if total else 0.0, step=step, total_steps=total,
        queue_position=queue_position, attempts=job.attempts, max_attempts=job.max_attempts,
        resumed_from_step=job.resumed_from_step, preemptions=job.preemptions or 0,
        cancel_requested=job.cancel_requested, created_at=job.created_at,
        started_at=job.started_at, finished_at=job.finished_at,
        render_seconds=job.render_seconds, gathers=job.gathers,
        blocks_computed=job.blocks_computed, input_file_id=job.input_file_id,
        fit=cast("FitMode | None", job.input_fit), strength=job.strength,  # checked on submit
        video_url=batches.video_url(job), thumbnail_url=batches.thumbnail_url(job),
        has_audio=job.has_audio,
        adapters=job.adapters,  # type: ignore[arg-type]  # pydantic reads the stored dicts
        quality=job.quality or "exact", error=_error(job),
    )


_VIDEO_STATUS: dict[JobState, VideoStatus] = {
    JobState.QUEUED: "queued", JobState.RUNNING: "in_progress", JobState.SUCCEEDED: "completed"}


def video_public(job: Job, *, retention_days: int = 0) -> VideoPublic:
    """The job as OpenAI's ``Video``; ``expires_at`` from the deployment's retention (0: kept
    for ever), counted from when the job ended, as retention counts it."""
    status_: VideoStatus = _VIDEO_STATUS.get(JobState(job.state), "failed")
    total = job.progress_total or job.num_inference_steps
    if status_ == "completed":
        progress = 100
    elif status_ == "in_progress" and total:
        progress = min(99, int(100 * job.progress_step / total))
    else:
        progress = 0
    seconds = (job.num_frames - 1) / job.fps
    error = None
    if status_ == "failed":
        error = VideoError(code=job.error_code or job.state, message=job.error or job.state)
    return VideoPublic(
        id=job.id, created_at=int(job.created_at.timestamp()),
        completed_at=int(job.finished_at.timestamp()) if job.finished_at else None,
        model=job.model, progress=progress, prompt=job.prompt, has_audio=job.has_audio,
        seconds=f"{seconds:g}", size=f"{job.width}x{job.height}", status=status_, error=error,
        remixed_from_video_id=job.source_job_id,
        expires_at=(int((job.finished_at + timedelta(days=retention_days)).timestamp())
                    if retention_days and job.finished_at else None),
    )


def now() -> datetime:
    return utcnow()
