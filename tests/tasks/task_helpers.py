"""Helpers for the task tests: settings, and jobs finished the way a worker group finishes them
(guarded claim and finish through the repository)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from common.settings import Settings
from kiln.tasks import Context
from storage import lifecycle, submission, webhook_secrets
from storage.outputs import thumbnail_key, video_key
from storage.submission import JobSpec
from storage.tables import Job, User
from storage.users import get_or_create_user

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SECRET = "s3cr3t-for-tests-only"  # a deployment-wide webhook_secret, where a test sets one


def make_settings(db_url: str, prefix: str, tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        # Local: the tests' webhook receivers listen on 127.0.0.1.
        environment="local",
        database_url=db_url, redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix,
        output_dir=tmp_path / "outputs", webhook_timeout_seconds=5,
        webhook_max_attempts=3, webhook_backoff_seconds=2, webhook_backoff_max_seconds=60,
    )
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def submit(session: Session, *, now: datetime = T0, owner: str = "alice", max_attempts: int = 3,
           **fields: Any) -> Job:
    values: dict[str, Any] = dict(model="kiln-tiny", prompt="a red circle", width=64, height=64,
                                  num_frames=9, fps=8, num_inference_steps=4, guidance_scale=5.0,
                                  seed=1)
    values.update(fields)
    owner_row = user(session, owner)
    return submission.create_job(session, owner_row, JobSpec(**values), request_hash="h",
                                 max_attempts=max_attempts, now=now).job


def succeed(ctx: Context, session: Session, job_id: str, *, now: datetime = T0,
            has_audio: bool | None = None) -> None:
    """Claims and finishes the job with a video and thumbnail in the store."""
    claim = lifecycle.claim_job(session, job_id, worker_group_id="g", rank=0, lease_seconds=60,
                                now=now)
    assert claim is not None
    ctx.store.put_bytes(video_key(job_id), b"mp4")
    ctx.store.put_bytes(thumbnail_key(job_id), b"png")
    assert lifecycle.finish_succeeded(session, job_id, claim.attempt_token,
                                      video_key=video_key(job_id),
                                      thumbnail_key=thumbnail_key(job_id), now=now,
                                      has_audio=has_audio)


def fail(session: Session, job_id: str, *, now: datetime = T0) -> None:
    claim = lifecycle.claim_job(session, job_id, worker_group_id="g", rank=0, lease_seconds=60,
                                now=now)
    assert claim is not None
    assert lifecycle.fail_job(session, job_id, claim.attempt_token, error="the prompt was refused",
                              code="bad_prompt", now=now) is not None


def user(session: Session, name: str = "alice") -> User:
    found = get_or_create_user(session, name)
    session.commit()
    return found


def secret_of(ctx: Context, name: str = "alice") -> str:
    """The user's own webhook secret, ``whsec_...`` (made if they have none yet)."""
    with ctx.sessions() as session:
        return webhook_secrets.ensure(session, user(session, name).id).secret
