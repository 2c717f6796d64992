"""`kiln submit / status / cancel` against the real API (uvicorn on a free port, real Redis, both
database backends), and the worker/beat arguments of `kiln celery`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import Service, serving_api
from sqlalchemy import select
from typer.testing import CliRunner

from common.procs import free_port
from kiln.cli import app as cli
from storage import lifecycle, submission
from storage.outputs import video_key
from storage.tables import Job

runner = CliRunner()


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice", "bob"),
                     redis_url="redis://unused", reconcile_interval_seconds=3600) as svc:
        yield svc


def render_when_queued(service: Service, *, fail: bool = False) -> threading.Thread:
    """A stand-in worker: claims the next queued job, reports each step, then finishes it."""

    def work() -> None:
        deadline = time.monotonic() + 30
        with service.db.session() as s:
            while (job_id := s.scalar(select(Job.id).where(Job.state == "queued"))) is None:
                assert time.monotonic() < deadline, "no job was submitted"
                time.sleep(0.05)
                s.rollback()
            claim = lifecycle.claim_job(s, job_id, worker_group_id="g", rank=0, lease_seconds=60)
            assert claim is not None
            for step in range(1, claim.job.num_inference_steps + 1):
                time.sleep(0.1)
                lifecycle.heartbeat(s, job_id, claim.attempt_token, step=step,
                                    num_inference_steps=claim.job.num_inference_steps,
                                    lease_seconds=60)
            if fail:
                lifecycle.fail_job(s, job_id, claim.attempt_token, error="out of device memory")
                return
            service.store.put_bytes(video_key(job_id), b"an mp4 file")
            lifecycle.finish_succeeded(s, job_id, claim.attempt_token, video_key=video_key(job_id))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_submit_wait_follows_progress_and_saves_the_video(service: Service,
                                                           tmp_path: Path) -> None:
    worker = render_when_queued(service)
    out = tmp_path / "videos" / "circle.mp4"
    result = service.kiln("submit", "a red circle", "--size", "64x48", "--frames", "9",
                          "--steps", "4", "--seed", "7", "--model", "kiln-tiny", "--wait",
                          "--out", str(out), "--poll", "0.05")
    worker.join(timeout=30)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.splitlines()[0]
    assert out.read_bytes() == b"an mp4 file"
    assert "succeeded" in result.stderr and "4/4" in result.stderr
    assert f"saved {out} (11 bytes)" in result.stderr
    with service.db.session() as s:
        job = s.get(Job, job_id)
        assert (job.width, job.height, job.num_frames, job.num_inference_steps, job.seed,
                job.model, job.prompt) == (64, 48, 9, 4, 7, "kiln-tiny", "a red circle")


def test_submit_wait_exits_1_with_the_reason_when_the_job_fails(service: Service) -> None:
    worker = render_when_queued(service, fail=True)
    result = service.kiln("submit", "a red circle", "--steps", "2", "--wait", "--poll", "0.05")
    worker.join(timeout=30)
    assert result.exit_code == 1
    job_id = result.stdout.splitlines()[0]
    assert f"error: job {job_id} failed: out of device memory" in result.stderr


def test_submit_prints_the_id_and_status_shows_the_job_and_the_recent_list(
        service: Service) -> None:
    first = service.kiln("submit", "first prompt")
    second = service.kiln("submit", "second prompt", "--steps", "3")
    assert first.exit_code == 0 and second.exit_code == 0
    first_id, second_id = first.stdout.strip(), second.stdout.strip()
    assert submission.is_job_id(first_id) and submission.is_job_id(second_id)

    one = service.kiln("status", second_id)
    assert one.exit_code == 0, one.output
    assert f"id: {second_id}" in one.stdout
    assert "status: queued, 1 ahead" in one.stdout
    assert "progress: 0/3 steps" in one.stdout

    table = service.kiln("status")
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if line.strip()]
    assert rows[0].split()[:3] == ["ID", "STATUS", "STEPS"]
    # Newest first.
    assert [r.split()[0] for r in rows[1:]] == [second_id, first_id]
    assert "second prompt" in rows[1] and "0/3" in rows[1]

    as_json = service.kiln("status", "--json", "--limit", "1")
    assert [j["id"] for j in json.loads(as_json.stdout)] == [second_id]
    # Bob sees none of alice's jobs.
    assert service.kiln("status", who="bob").stdout.strip() == "no jobs"


def test_cancel_cancels_a_queued_job_and_refuses_a_finished_one_with_the_reason(
        service: Service) -> None:
    worker = render_when_queued(service)
    finished = service.kiln("submit", "rendered", "--steps", "1", "--wait", "--poll", "0.05")
    worker.join(timeout=30)
    assert finished.exit_code == 0, finished.output
    queued = service.kiln("submit", "a red circle").stdout.strip()

    done = service.kiln("cancel", queued)
    assert done.exit_code == 0 and done.stdout.strip() == f"cancelled {queued}"
    # Cancelling twice is harmless.
    assert service.kiln("cancel", queued).exit_code == 0
    running = service.kiln("submit", "a long one").stdout.strip()
    with service.db.session() as s:
        assert lifecycle.claim_job(s, running, worker_group_id="g", rank=0, lease_seconds=60)
    flagged = service.kiln("cancel", running)
    assert flagged.exit_code == 0
    assert flagged.stdout.strip() == f"cancel requested; {running} stops after its current step"
    assert "status: running, cancelling" in service.kiln("status", running).stdout
    refused = service.kiln("cancel", finished.stdout.splitlines()[0])
    assert refused.exit_code == 1
    assert refused.stderr.strip() == (
        "error: the job already succeeded; there is nothing to cancel (HTTP 409)")


@pytest.mark.parametrize(("args", "who", "message"), [
    (["submit", "x", "--size", "65x64"], "alice", "width: "),
    (["submit", "x", "--model", "nope"], "alice", "model"),
    (["status", "aaaaaaaaaaaaaaaaaaaa"], "alice", "error: job not found (HTTP 404)"),
    (["cancel", "aaaaaaaaaaaaaaaaaaaa"], "bob", "error: job not found (HTTP 404)"),
])
def test_refused_requests_print_the_api_reason_on_one_line_and_exit_1(
        service: Service, args: list[str], who: str, message: str) -> None:
    result = service.kiln(*args, who=who)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    if args[0] == "submit":
        assert "(HTTP 422)" in lines[0] and result.stdout == ""


def test_a_bad_key_and_an_unreachable_api_are_clear_errors(service: Service) -> None:
    bad = runner.invoke(cli, ["status", "--api", service.url, "--key", "kiln_nope"])
    assert bad.exit_code == 1
    assert "(HTTP 401)" in bad.stderr and "KILN_API_KEY" in bad.stderr
    nobody = f"http://127.0.0.1:{free_port()}"
    down = runner.invoke(cli, ["status"], env={"KILN_API_URL": nobody, "KILN_API_KEY": "k"})
    assert down.exit_code == 1
    assert down.stderr.startswith(f"error: cannot reach the API at {nobody}")


def test_a_malformed_size_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["submit", "x", "--size", "wide"])
    assert result.exit_code == 2
    assert "expected WIDTHxHEIGHT" in result.stderr


@pytest.mark.parametrize(("args", "argv"), [
    ([], ["worker", "--loglevel=INFO", "--concurrency=2", "--beat"]),
    (["--no-beat"], ["worker", "--loglevel=INFO", "--concurrency=2"]),
    (["worker", "--concurrency", "4"], ["worker", "--loglevel=INFO", "--concurrency=4"]),
    (["worker", "--beat"], ["worker", "--loglevel=INFO", "--concurrency=2", "--beat"]),
    (["beat"], ["beat", "--loglevel=INFO"]),
])
def test_celery_runs_a_worker_with_embedded_beat_by_default_or_the_role_asked_for(
        monkeypatch: pytest.MonkeyPatch, redis_prefix: str, args: list[str],
        argv: list[str]) -> None:
    from kiln import tasks

    started: list[list[str]] = []

    class App:  # what kiln celery needs of the app make_celery builds
        start = staticmethod(started.append)

    monkeypatch.setattr(tasks, "make_celery", lambda settings: App())
    result = runner.invoke(cli, ["celery", *args],
                           env={"REDIS_URL": "redis://127.0.0.1:6379/0",
                                "KILN_REDIS_PREFIX": redis_prefix})
    assert result.exit_code == 0, result.output
    assert started == [argv]


def test_celery_without_redis_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("KILN_REDIS_URL", raising=False)
    result = runner.invoke(cli, ["celery"])
    assert result.exit_code == 2 and "no Redis configured" in result.stderr


def test_submit_with_an_image_uploads_it_and_the_job_names_it(service: Service,
                                                              tmp_path: Path) -> None:
    from PIL import Image

    start = tmp_path / "start.png"
    Image.new("RGB", (40, 24), (200, 30, 30)).save(start)
    result = service.kiln("submit", "a red square moving left", "--image", str(start),
                          "--fit", "pad")
    assert result.exit_code == 0, result.output
    with service.db.session() as s:
        job = s.scalars(select(Job).where(Job.id == result.stdout.strip())).one()
    assert job.input_file_id is not None and job.input_fit == "pad"
    # kiln-tiny takes a first frame, not a clip: refused with the reason, no job made.
    clip = tmp_path / "clip.png"
    Image.new("RGB", (40, 24)).save(clip)
    refused = service.kiln("submit", "p", "--video", str(clip))
    assert refused.exit_code == 1 and "video" in refused.stderr, refused.output


def test_submit_with_a_quality_tier_stores_it(service: Service) -> None:
    result = service.kiln("submit", "a red circle", "--quality", "fast")
    assert result.exit_code == 0, result.output
    with service.db.session() as s:
        assert s.scalars(select(Job).where(Job.id == result.stdout.strip())).one().quality \
            == "fast"
