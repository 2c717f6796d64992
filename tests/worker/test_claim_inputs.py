"""A claimed job that starts from an input file: the worker reads the stored upload, decodes it
again and fits it to the job's size, so the rank's request carries pixels and never a file; a
job whose file is gone fails at the claim with the reason, not on a rank."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import redis
from PIL import Image
from sqlalchemy.orm import Session

from common.settings import Settings
from kiln.group_io import ServerIO
from scheduler import queue_index
from storage import input_files, media, submission
from storage.outputs import LocalStore
from storage.submission import JobSpec
from storage.tables import InputFile, Job, JobState
from storage.users import get_or_create_user
from tests.conftest import REDIS_URL


def _png(width: int, height: int) -> bytes:
    """A left half red, right half blue image: a fit that crops or pads shows in the pixels."""
    image = Image.new("RGB", (width, height), (220, 20, 20))
    image.paste((20, 20, 220), (width // 2, 0, width, height))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _setup(db, session: Session, r: redis.Redis, prefix: str, tmp_path: Path, *,  # noqa: ANN001
           fit: str, data: bytes | None = None,
           name: str = "start.png") -> tuple[ServerIO, Job, LocalStore, str]:
    settings = Settings(_env_file=None, database_url=db.url, redis_url=REDIS_URL,  # type: ignore[call-arg]
                        redis_prefix=prefix, output_dir=tmp_path / "outputs")
    store = LocalStore(settings.output_dir)
    owner = get_or_create_user(session, "alice")
    data = _png(128, 64) if data is None else data
    found = media.check(io.BytesIO(data), media.Limits.of(settings), filename=name)
    row = input_files.new_input_file(owner, found, file_id=input_files.new_file_id(),
                                     purpose="user_data", filename=name,
                                     size_bytes=len(data))
    store.put_bytes(row.storage_key, data)
    session.add(row)
    session.commit()
    spec = JobSpec(model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9,
                   fps=8, num_inference_steps=4, guidance_scale=5.0, seed=1,
                   input_file_id=row.id, input_fit=fit)
    job = submission.create_job(session, owner, spec, request_hash="h").job
    queue_index.add(r, prefix, [job])
    io_ = ServerIO(settings, group_id="g1", model="kiln-tiny", sp=1,
                   notify=lambda s, j: None, send_event=lambda *a: None)
    return io_, job, store, row.id


def test_the_claimed_request_carries_the_input_fitted_to_the_jobs_size(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path) -> None:
    group, job, _, _ = _setup(db, session, redis_client, redis_prefix, tmp_path, fit="pad")
    try:
        [claimed] = group.claim([0], [], prefer="interactive", job_class=None)
    finally:
        group.close()
    image = claimed.ticket.request.conditioning.image
    assert claimed.ticket.job_id == job.id
    assert image.dtype.is_floating_point is False and tuple(image.shape) == (64, 64, 3)
    expected = np.asarray(media.fit(Image.open(io.BytesIO(_png(128, 64))), 64, 64, "pad"))
    assert np.array_equal(image.numpy(), expected)
    # Padded, not cropped: black bars above and below, red and blue both kept.
    assert image[0].max() == 0 and image[32, 5, 0] > 200 and image[32, 60, 2] > 200


def test_a_job_whose_input_was_deleted_fails_at_the_claim_with_the_reason(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path) -> None:
    group, job, store, file_id = _setup(db, session, redis_client, redis_prefix, tmp_path,
                                        fit="crop")
    row = session.get(InputFile, file_id)
    store.delete(row.storage_key)
    input_files.forget_input_file(session, file_id)
    try:
        assert group.claim([0], [], prefer="interactive", job_class=None) == []
    finally:
        group.close()
    session.expire_all()
    failed = session.get(Job, job.id)
    assert failed.state == JobState.FAILED.value and failed.error_code == "input_unavailable"
    assert "the input file cannot be read" in failed.error


def test_a_clip_shorter_than_the_job_holds_its_last_frame_to_the_jobs_length(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path) -> None:
    from media_files import video

    group, _, _, _ = _setup(db, session, redis_client, redis_prefix, tmp_path, fit="crop",
                            data=video(frames=5, size=64), name="clip.mp4")
    try:
        [claimed] = group.claim([0], [], prefer="interactive", job_class=None)
    finally:
        group.close()
    clip = claimed.ticket.request.conditioning.video
    assert tuple(clip.shape) == (9, 64, 64, 3)  # the job's 9 frames from a 5-frame clip
    assert all(bool((clip[i] == clip[4]).all()) for i in range(5, 9))
    assert not bool((clip[3] == clip[4]).all())


def test_a_jobs_quality_tier_reaches_the_rank_as_its_step_cache_threshold(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path) -> None:
    settings = Settings(_env_file=None, database_url=db.url, redis_url=REDIS_URL,  # type: ignore[call-arg]
                        redis_prefix=redis_prefix, output_dir=tmp_path / "outputs")
    owner = get_or_create_user(session, "alice")
    jobs = []
    for quality in ("fast", "balanced", None):
        spec = JobSpec(model="kiln-tiny", prompt="a red circle", width=64, height=64,
                       num_frames=9, fps=8, num_inference_steps=4, guidance_scale=5.0, seed=1,
                       quality=quality)
        jobs.append(submission.create_job(session, owner, spec, request_hash=str(quality)).job)
    queue_index.add(redis_client, redis_prefix, jobs)
    group = ServerIO(settings, group_id="g1", model="kiln-tiny", sp=1,
                     notify=lambda s, j: None, send_event=lambda *a: None)
    try:
        claimed = group.claim([0, 1, 2], [], prefer="interactive", job_class=None)
    finally:
        group.close()
    by_job = {c.ticket.job_id: c.ticket.request.step_cache for c in claimed}
    assert [by_job[j.id] for j in jobs] == [0.2, 0.1, None]
