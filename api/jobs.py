"""What the routes share: turning requests into checked job specs, submitting (row first, Redis
after the commit), and rendering rows as native jobs or OpenAI videos."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

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
    metadata_bytes,
)
from common import netguard
from common.families import GENERIC, Family, checkpoint_family, family_of, tokens
from common.render import RequestDefaults
from common.settings import Settings
from scheduler import queue_index
from storage import idempotency, submission
from storage.submission import Created, JobSpec
from storage.tables import Job, JobClass, JobState, User, utcnow

log = logging.getLogger(__name__)


class _Problems:
    """Collects limit violations so one 422 lists all of them, each naming its field."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def add(self, field: str | None, message: str) -> None:
        """``field`` None: the request as a whole (a bound on several fields at once)."""
        loc = ("body",) if field is None else ("body", field)
        self.errors.append({"loc": loc, "msg": message, "type": "limit"})

    def raise_if_any(self) -> None:
        if self.errors:
            raise RequestValidationError(self.errors)


def admission_family(s: Settings, model: str) -> Family:
    """The family whose rules a request for ``model`` is held to: the checkpoint's own
    (`common.families.checkpoint_family`, what its pipeline checks when the job starts);
    `GENERIC` for a model this API does not serve, which is never looked up on disk."""
    return checkpoint_family(model) if model in s.models else GENERIC


def size_multiple(s: Settings, family: Family) -> int:
    """Width and height are multiples of this: of the family's multiple and the deployment's."""
    return math.lcm(family.size_multiple, s.size_multiple)


def frame_stride(s: Settings, family: Family) -> int:
    """A clip has ``family.frame_base`` + k x this many frames: for the causal VAEs (1 + k x
    their stride) the family's stride and the deployment's together; a family with a rule of
    its own (MiniMax-H3's 5 + 17k) keeps its own, which no deployment stride composes with."""
    if family.frame_base != 1:
        return family.frame_stride
    return math.lcm(family.frame_stride, s.frame_stride)


def frame_bounds(s: Settings, family: Family) -> tuple[int, int]:
    """The fewest and the most frames a clip of ``family`` may have here."""
    most = min(s.max_num_frames, family.max_frames or s.max_num_frames)
    return family.min_frames, most


def _nearest(value: int, step: int, low: int, high: int, base: int = 0) -> str:
    """The valid values (``base`` + k x ``step`` within [low, high]) either side of ``value``,
    as a clause for a message ("" when none is in range)."""
    below = base + (value - base) // step * step
    near = [below, below + step]
    if value > high:  # past the range: its last valid value
        near = [base + (high - base) // step * step]
    elif value < low:  # short of it: its first
        near = [low + (base - low) % step]
    found = [str(v) for v in near if low <= v <= high]
    return f"; nearest: {' or '.join(found)}" if found else ""


def _most_frames(spec: JobSpec, family: Family, stride: int, max_tokens: int) -> int | None:
    """The most frames (base + k x ``stride``, from the family's fewest to the request's) that
    keep ``spec``'s size within ``max_tokens``; None when the fewest are already too many."""
    base = family.frame_base
    for k in range((spec.num_frames - base) // stride, -1, -1):
        n = base + k * stride
        if n < family.min_frames:
            break
        if tokens(spec.width, spec.height, n, family=family) <= max_tokens:
            return n
    return None


def _check_work(p: _Problems, s: Settings, spec: JobSpec, family: Family, stride: int,
                seconds: bool) -> None:
    """The largest job the deployment accepts (``max_job_tokens`` per step, ``max_job_work``
    in tokens x steps), in video tokens per transformer forward (`common.families.tokens`)."""
    num_tokens = tokens(spec.width, spec.height, spec.num_frames, family=family)
    shape = f"{spec.width}x{spec.height}, {spec.num_frames} frames"
    max_tokens = s.max_job_tokens or family.max_tokens
    max_work = s.max_job_work or 50 * max_tokens
    if num_tokens > max_tokens:
        fit = _most_frames(spec, family, stride, max_tokens)
        at = f"at {spec.width}x{spec.height}"
        if fit is not None and seconds and (fit - 1) // spec.fps >= 1:
            how = f"fewer seconds (at most {(fit - 1) // spec.fps} {at}) or a smaller size"
        elif fit is not None and not seconds:
            how = f"fewer frames (at most {fit} {at}) or a smaller size"
        else:
            how = "a smaller size"
        p.add(None, f"the job is too large: {shape} is {num_tokens:,} video tokens per step, "
                    f"over this deployment's max_job_tokens of {max_tokens:,}; use {how}")
        return
    work = num_tokens * spec.num_inference_steps
    if work > max_work:
        steps = max_work // num_tokens
        fewer = f"fewer steps (at most {steps} at {shape}), " if steps else ""
        p.add(None, f"the job is too large: {shape} is {num_tokens:,} video tokens x "
                    f"{spec.num_inference_steps} steps = {work:,}, over this deployment's "
                    f"max_job_work of {max_work:,}; use {fewer}a smaller size or fewer "
                    f"{'seconds' if seconds else 'frames'}")


def _check_common(p: _Problems, s: Settings, spec: JobSpec, now: datetime,
                  size_fields: tuple[str, str] = ("width", "height"),
                  frames_field: str = "num_frames") -> None:
    if spec.model not in s.models:
        p.add("model", f"unknown model {spec.model!r}; available: {', '.join(s.models)}")
    # Sizes and lengths by the model's own rule and the deployment's at once, so that what is
    # accepted here is what the model's pipeline renders.
    family = admission_family(s, spec.model)
    multiple, stride = size_multiple(s, family), frame_stride(s, family)
    base, (fewest, most) = family.frame_base, frame_bounds(s, family)
    shape_ok = True
    for field, name, value, bound in ((size_fields[0], "width", spec.width, s.max_width),
                                      (size_fields[1], "height", spec.height, s.max_height)):
        which = "" if field == name else f"{name} "  # the OpenAI body's one ``size`` field
        if not s.min_size <= value <= bound:
            p.add(field, f"{which}must be between {s.min_size} and {bound}, got {value}")
            shape_ok = False
        elif value % multiple:
            p.add(field, f"{which}must be a multiple of {multiple}, got {value}"
                         f"{_nearest(value, multiple, s.min_size, bound)}")
            shape_ok = False
    seconds = frames_field == "seconds"  # the OpenAI body gives the length in seconds
    if spec.num_frames > s.max_num_frames:
        if seconds:
            most = (s.max_num_frames - 1) // stride * stride // spec.fps
            p.add(frames_field, f"at most {most} s at {spec.fps} fps ({s.max_num_frames} frames), "
                                f"got {spec.num_frames} frames; use fewer seconds or a lower fps")
        else:
            p.add(frames_field, f"at most {s.max_num_frames} frames, got {spec.num_frames}")
        shape_ok = False
    elif (spec.num_frames - base) % stride or not fewest <= spec.num_frames <= most:
        first = fewest + (base - fewest) % stride  # the fewest that keeps the rule
        last = most - (most - base) % stride  # and the most
        within = f" from {first} to {last}" if fewest > 1 or most < s.max_num_frames else ""
        p.add(frames_field, f"must be {base} + a multiple of {stride} frames{within} "
                            f"({first}, {first + stride}, {first + 2 * stride}, ...), got "
                            f"{spec.num_frames}"
                            f"{_nearest(spec.num_frames, stride, fewest, most, base=base)}")
        shape_ok = False
    if shape_ok:
        _check_work(p, s, spec, family, stride, seconds)
    if spec.fps > s.max_fps:
        p.add("fps", f"at most {s.max_fps}, got {spec.fps}")
    if spec.num_inference_steps > s.max_num_inference_steps:
        p.add("num_inference_steps",
              f"at most {s.max_num_inference_steps}, got {spec.num_inference_steps}")
    if spec.guidance_scale > s.max_guidance_scale:
        p.add("guidance_scale", f"at most {s.max_guidance_scale}, got {spec.guidance_scale}")
    if len(spec.prompt) > s.max_prompt_chars:
        p.add("prompt", f"at most {s.max_prompt_chars} characters, got {len(spec.prompt)}")
    if spec.negative_prompt is not None and len(spec.negative_prompt) > s.max_prompt_chars:
        p.add("negative_prompt", f"at most {s.max_prompt_chars} characters")
    if not spec.prompt.strip():
        p.add("prompt", "must not be blank")
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


def spec_from_job_create(body: JobCreate, s: Settings, now: datetime) -> JobSpec:
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
    )
    p = _Problems()
    _check_common(p, s, spec, now)
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
        family = admission_family(s, model)
        stride, base = frame_stride(s, family), family.frame_base
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
    if job.error is None or job.state in (JobState.QUEUED, JobState.RUNNING,
                                          JobState.SUCCEEDED):
        return None
    return JobError(code=job.error_code or job.state, message=job.error)


def job_public(job: Job, *, queue_position: int | None = None,
               owner: str | None = None) -> JobPublic:
    # The step count (num_inference_steps) as the progress report recorded it: the row's
    # progress_total column, public as total_steps.
    total = job.progress_total or job.num_inference_steps
    step = total if job.state == JobState.SUCCEEDED else min(job.progress_step, total)
    done = job.state == JobState.SUCCEEDED
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
        render_seconds=job.render_seconds,
        video_url=f"/v1/jobs/{job.id}/video" if done and job.output_video_key else None,
        thumbnail_url=(f"/v1/jobs/{job.id}/thumbnail"
                       if done and job.output_thumbnail_key else None),
        error=_error(job),
    )


_VIDEO_STATUS = {JobState.QUEUED: "queued", JobState.RUNNING: "in_progress",
                 JobState.SUCCEEDED: "completed"}


def video_public(job: Job) -> VideoPublic:
    status_ = _VIDEO_STATUS.get(JobState(job.state), "failed")
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
        model=job.model, progress=progress, prompt=job.prompt,
        seconds=f"{seconds:g}", size=f"{job.width}x{job.height}", status=status_, error=error,
    )


def now() -> datetime:
    return utcnow()
