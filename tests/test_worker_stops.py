"""A worker group's stops and leases against real servers and real worker processes: SIGTERM to
the whole group drains for a bounded time and hands the running job back without charging it,
however often it happens. A 1920x1920 job is refused at the door; a step several leases long
(stored past the door) keeps its job, and the tiny jobs beside it keep theirs, none charged."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from servers import Service, api_client, job_row, serving_api, wait_job, worker_group
from sqlalchemy import func, select

from kiln.tasks import Context, reap_leases
from scheduler import queue_index
from storage import queries, submission
from storage.tables import Base, User

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

DRAIN = 1.0  # seconds the running job has to finish after the SIGTERM
# Long enough that the job is still running when the SIGTERM comes (a 256x256x17 step takes
# ~0.15 s on a CPU rank), short enough for the last group to finish it.
JOB = {"model": "kiln-tiny", "prompt": "a red circle moving left", "width": 256, "height": 256,
       "num_frames": 17, "num_inference_steps": 60, "fps": 8, "seed": 3}








@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
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
# The short lease stands in for the default 120 s one, which no CI step could outlast: what is
# shown is a step several leases long, whatever the lease.
SLOW = dict(width=704, height=704, num_frames=57, fps=8, num_inference_steps=1)
TINY = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8,
        "num_inference_steps": 4}


def _store_slow_job(service: Service, redis_client: Any, owner: str, **fields: Any) -> str:
    """A job with one SLOW step, stored directly: the deployment's admission rules (which refuse
    a step this long at the door) are not what the lease test is about."""
    with service.db.session() as s:
        user = s.scalars(select(User).where(User.name == owner)).one()
        spec = submission.JobSpec(model="kiln-tiny", prompt="a slow blue square",
                                  guidance_scale=5.0, **SLOW, **fields)
        job = submission.create_job(s, user, spec, request_hash="s" * 64).job
        queue_index.add(redis_client, service.settings.redis_prefix, [job])
        return job.id


def _until_running(service: Service, ids: list[str], timeout: float = 10) -> list[Any]:
    """The rows of the jobs among ``ids`` that run, once one does."""
    deadline = time.monotonic() + timeout
    while not (running := [r for j in ids if (r := job_row(service, j)).state == "running"]):
        assert time.monotonic() < deadline, "none of them runs"
        time.sleep(0.1)
    return running


def _untouched(service: Service, redis_client: Any) -> dict[str, Any]:
    """What a refused request must not change: every table's row count and every Redis key of
    the deployment's prefix, with its value."""
    with service.db.session() as s:
        counts = {t.name: s.scalar(select(func.count()).select_from(t))
                  for t in Base.metadata.sorted_tables}
    keys = sorted(redis_client.scan_iter(match=f"{service.settings.redis_prefix}*"))
    return {"rows": counts, "redis": {k: redis_client.dump(k) for k in keys}}


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_1920_job_is_refused_at_the_door_and_a_step_of_many_leases_beside_tiny_jobs_costs_none(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice", "bob"),
                     lease_seconds=LEASE) as service, api_client(service) as client, \
            api_client(service, "bob") as bob:
        # The 1920x1920x9 request (125 s a step on a CPU rank) no longer gets a 201 to
        # lose its lease later: the door says which rule and what fits, and stores nothing.
        before = _untouched(service, redis_client)
        r = client.post("/v1/jobs", json={**TINY, "prompt": "a huge red circle", "width": 1920,
                                          "height": 1920})
        assert r.status_code == 422, r.text
        assert "max_job_tokens" in r.json()["detail"]
        assert "use fewer frames (at most 1 at 1920x1920) or a smaller size" in r.json()["detail"]
        assert _untouched(service, redis_client) == before

        reaper = Context(settings=service.settings, sessions=db.session,  # type: ignore[arg-type]
                         redis=redis_client, store=service.store)
        with worker_group(service, dp=2, lease_seconds=LEASE) as group:
            # All due at one instant, so one claim of the idle group's two replicas sees them
            # all; bob's big job and alice's tiny ones are at one level, so fairness gives each
            # user a replica: the big job starts beside a tiny one.
            due = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
            tiny = [client.post("/v1/jobs", json={**TINY, "prompt": f"a tiny dot {i}", "seed": i,
                                                  "not_before": due}).json()["id"]
                    for i in range(3)]
            big = _store_slow_job(service, redis_client, "bob",
                                  not_before=datetime.fromisoformat(due))
            wait_job(bob, big, timeout=60, until=lambda j: j["status"] == "running")
            started = time.monotonic()
            # Claimed in the same turn (its commit may trail the big job's by a moment).
            [beside] = _until_running(service, tiny)
            big_row = job_row(service, big)
            assert beside.rank != big_row.rank, "the tiny job runs on the other replica"
            tokens = {big: big_row.attempt_token, beside.id: beside.attempt_token}
            # Past two leases into the big job's one step (the tiny job beside it steps at its
            # pace meanwhile), the reaper finds nothing lapsed, and neither job changed hands.
            while time.monotonic() - started < 2.5 * LEASE:
                assert reap_leases(reaper).requeued == []
                time.sleep(1)
            now = {j: job_row(service, j) for j in tokens}
            assert now[big].state == "running" and now[big].progress_step == 0, "in its step"
            assert now[beside.id].state == "running", "the tiny job waits for the step too"
            assert {j: row.attempt_token for j, row in now.items()} == tokens
            for who, job_id in [(bob, big), *((client, j) for j in tiny)]:
                wait_job(who, job_id, timeout=180,
                         until=lambda j: j["status"] not in ("queued", "running"))
            assert group.poll() is None
        ids = [big, *tiny]
        ended = [job_row(service, j) for j in ids]
        assert [(r.state, r.attempts, r.uncharged_attempts) for r in ended] == [
            ("succeeded", 1, 0)] * len(ids), [(r.id, r.state, r.error) for r in ended]
        with service.db.session() as s:
            kinds = [[e.kind for e in queries.job_events(s, j)] for j in ids]
        assert kinds == [["created", "claimed", "succeeded"]] * len(ids), kinds
