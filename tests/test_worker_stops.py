"""A worker group's stops and leases against real servers and real worker processes: SIGTERM to
the whole group drains for a bounded time and hands the running job back without charging it,
however often it happens; a step longer than the lease keeps its job."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from servers import api_client, job_row, serving_api, wait_job, worker_group
from sqlalchemy import select

from kiln.tasks import Context, reap_leases
from scheduler import queue_index
from storage import queries, submission
from storage.tables import User

DRAIN = 1.0  # seconds the running job has to finish after the SIGTERM
# Long enough that the job is still running when the SIGTERM comes (a 256x256x17 step takes
# ~0.15 s on a CPU rank), short enough for the last group to finish it.
JOB = {"model": "kiln-tiny", "prompt": "a red circle moving left", "width": 256, "height": 256,
       "num_frames": 17, "num_inference_steps": 60, "fps": 8, "seed": 3}








def test_sigterm_to_the_group_drains_then_hands_the_job_back_uncharged_every_time(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client:
        job_id = client.post("/v1/jobs", json=JOB).json()["id"]
        # More stops than the job has attempts: none of them is its fault.
        stops = service.settings.max_attempts + 1
        for n in range(1, stops + 1):
            with worker_group(service, dp=2, args=["--drain-seconds", str(DRAIN)]) as group:
                wait_job(client, job_id, timeout=60,
                      until=lambda j: j["status"] == "running" and j["step"] >= 1)
                asked = time.monotonic()
                os.killpg(group.pid, signal.SIGTERM)  # what systemd and docker send
                assert group.wait(timeout=30) == 0
                took = time.monotonic() - asked
            # Bounded: the drain, the step in progress, the hand-back and the group's report.
            assert took < DRAIN + 10, took
            job = job_row(service, job_id)
            assert job.state == "queued", (n, job.state, job.error)
            assert (job.attempts, job.uncharged_attempts) == (n, n)
            assert job.error_code == "worker_stopped"
            assert queue_index.position(redis_client, service.settings.redis_prefix, job) == 0
        with service.db.session() as s:
            events = queries.job_events(s, job_id)
        handed_back = [e for e in events if e.kind == "requeued"]
        assert len(handed_back) == stops
        assert all(e.detail["charged"] is False for e in handed_back)
        assert [e.attempt for e in events if e.kind == "claimed"] == list(range(1, stops + 1))

        # A group that is left alone renders it: the job was never charged for the stops.
        with worker_group(service, dp=2):
            done = wait_job(client, job_id, timeout=120,
                         until=lambda j: j["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded", done
        assert done["attempts"] == stops + 1 > service.settings.max_attempts


LEASE = 5  # seconds; the setting's minimum
# One step of this takes ~30 s on a 2-core CPU (29,040 tokens, the guidance pair as one
# batch-2 forward): six leases, so the test sees two and a half of them pass within the step.
SLOW = dict(width=704, height=704, num_frames=57, fps=8, num_inference_steps=1)


def test_a_step_longer_than_the_lease_keeps_its_job_while_the_group_lives(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     lease_seconds=LEASE) as service, api_client(service) as client:
        reaper = Context(settings=service.settings, sessions=db.session,  # type: ignore[arg-type]
                         redis=redis_client, store=service.store)
        with worker_group(service, dp=1, lease_seconds=LEASE):
            # Stored directly: the deployment's admission rules are not what this is about.
            with db.session() as s:
                alice = s.scalars(select(User).where(User.name == "alice")).one()
                spec = submission.JobSpec(model="kiln-tiny", prompt="a slow blue square",
                                          guidance_scale=5.0, **SLOW)
                job = submission.create_job(s, alice, spec, request_hash="s" * 64).job
                queue_index.add(redis_client, service.settings.redis_prefix, [job])
            running = wait_job(client, job.id, timeout=60, until=lambda j: j["status"] == "running")
            started = time.monotonic()
            token = job_row(service, job.id).attempt_token
            # Past two leases into the first (and only) step, the reaper finds nothing lapsed.
            while time.monotonic() - started < 2.5 * LEASE:
                assert reap_leases(reaper).requeued == []
                time.sleep(1)
            now = job_row(service, job.id)
            assert now.state == "running" and now.progress_step == 0, "still in its one step"
            assert now.attempt_token == token
            done = wait_job(client, job.id, timeout=180,
                         until=lambda j: j["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded" and done["attempts"] == 1, done
        assert running["attempts"] == 1
