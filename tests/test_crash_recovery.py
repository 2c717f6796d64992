"""Nothing is lost when a process dies: a worker group killed with SIGKILL in the middle of a
render loses no job.

Real servers only, on both database backends: the API over HTTP, the real Redis, and
``kiln worker --dp 2`` process groups. The first group is killed outright (no graceful
give-back), the lease reaper the Celery beat runs (`kiln.tasks.reap_leases`) puts the job back
once its lease has lapsed, and a new group renders it to the same video `kiln render` makes.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from servers import decoded, job_row, serving_api, worker_group

from kiln.tasks import Context, reap_leases
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline
from scheduler import queue_index
from storage import lifecycle, queries
from storage.outputs import checkpoint_key
from storage.tables import Job, utcnow
from storage.video import write_outputs

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

LEASE = 5  # seconds; the setting's minimum
# Enough steps that the render is still going when the group is killed (a step takes ~30 ms on
# a CPU rank of a dp=2 group: ~4.5 s in all), few enough that the rerun keeps the test short.
STEPS = 150
JOB = {"model": "kiln-tiny", "prompt": "a red circle moving left", "width": 64, "height": 64,
       "num_frames": 9, "num_inference_steps": STEPS, "fps": 8, "seed": 7}


def _wait(client: httpx.Client, job_id: str, until: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        if until(job):
            return job
        assert job["status"] in ("queued", "running"), job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def _kill_group(launcher: Any) -> None:
    """SIGKILL to the launcher's whole process group; returns once none of it is left."""
    members = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    assert len(members) >= 3, "the launcher and its two ranks"
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    _, alive = psutil.wait_procs(members, timeout=10)
    alive = [p for p in alive if _still_running(p)]
    assert not alive, f"processes of the killed group survived: {alive}"


def _still_running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False




@pytest.mark.chaos  # slow: `make chaos` runs it; make test keeps the killed-rank restarts
def test_a_job_whose_worker_group_is_killed_mid_render_is_requeued_and_rendered_again(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     lease_seconds=LEASE) as service, \
            httpx.Client(base_url=service.url, timeout=30,
                         headers={"Authorization": f"Bearer {service.keys['alice']}"}) as client:
        reaper = Context(settings=service.settings, sessions=db.session,  # type: ignore[arg-type]
                         redis=redis_client, store=service.store)

        # 1. A group starts rendering the job and is killed outright in the middle of it.
        with worker_group(service, dp=2, lease_seconds=LEASE) as first:
            r = client.post("/v1/jobs", json=JOB)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            running = _wait(client, job_id, timeout=60,
                            until=lambda j: j["status"] == "running" and j["progress"] >= 0.25)
            _kill_group(first)

        killed = job_row(service, job_id)
        assert killed.state == "running" and killed.attempts == 1
        assert 0 < killed.progress_step < STEPS, "killed in the middle of its render"
        assert running["step"] <= killed.progress_step
        old_token = killed.attempt_token
        assert old_token is not None and killed.lease_expires_at is not None
        # The killed attempt wrote no output, whole or partial (a running job's preview frame
        # is not one of its outputs; the next attempt replaces it and removes it at the end).
        outputs = Path(service.settings.output_dir)
        assert not outputs.exists() or not any(
            p.is_file() for p in outputs.rglob("*")
            if "previews" not in p.parts and "checkpoints" not in p.parts)

        # 2. While the lease holds, the reaper leaves the job alone; once it lapses, the reaper
        # puts the job back in the queue and in the queue index.
        almost = killed.lease_expires_at - timedelta(seconds=1)
        assert reap_leases(reaper, now=almost).requeued == []
        assert job_row(service, job_id).state == "running"
        while utcnow() <= killed.lease_expires_at:
            time.sleep(0.1)
        reaped = reap_leases(reaper)
        assert reaped.requeued == [job_id] and reaped.dead == [] and reaped.cancelled == []

        queued = client.get(f"/v1/jobs/{job_id}").json()
        assert queued["status"] == "queued" and queued["attempts"] == 1, queued
        assert queued["step"] == 0 and queued["queue_position"] == 0, queued
        with db.session() as s:
            events = queries.job_events(s, job_id)
            row = s.get(Job, job_id)
            assert row is not None
            assert row.error_code == "lease_expired" and row.attempt_token is None
            assert queue_index.position(redis_client, redis_prefix, row) == 0
        assert [e.kind for e in events] == ["created", "claimed", "requeued"], events
        assert events[-1].attempt == 1 and events[-1].detail == {"reason": "lease expired"}

        # 3. The killed attempt can no longer change the row.
        with db.session() as s:
            assert lifecycle.heartbeat(s, job_id, old_token, step=STEPS - 1,
                                       num_inference_steps=STEPS, lease_seconds=LEASE) is None
            assert not lifecycle.finish_succeeded(s, job_id, old_token, video_key="forged.mp4")
            assert lifecycle.fail_job(s, job_id, old_token, error="late", retryable=True) is None
        after = job_row(service, job_id)
        assert (after.state, after.attempts, after.progress_step) == ("queued", 1, 0)
        checkpointed = service.store.exists(checkpoint_key(job_id))

        # 4. A new group on the same database and Redis picks the job up and renders it.
        with worker_group(service, dp=2, lease_seconds=LEASE):
            done = _wait(client, job_id, timeout=60, until=lambda j: j["status"] == "succeeded")
        assert done["attempts"] == 2 and done["progress"] == 1, done
        finished = job_row(service, job_id)
        assert finished.attempt_token not in (None, old_token)
        assert finished.output_video_key != "forged.mp4"
        with db.session() as s:
            kinds = [e.kind for e in queries.job_events(s, job_id)]
        # The second attempt resumed from the killed one's newest checkpoint, if it wrote one.
        assert [k for k in kinds if k != "resumed"] == [
            "created", "claimed", "requeued", "claimed", "succeeded"], kinds
        assert ("resumed" in kinds) == checkpointed, kinds
        if checkpointed:  # every 5 steps: little of the killed attempt is computed again
            assert finished.resumed_from_step is not None
            assert finished.resumed_from_step >= killed.progress_step - 10, (
                finished.resumed_from_step, killed.progress_step)
            print(f"killed at step {killed.progress_step}, resumed from step "
                  f"{finished.resumed_from_step}")

        # Its video is the one `kiln render` makes for the same request and seed.
        r = client.get(f"/v1/jobs/{job_id}/video")
        assert r.status_code == 200
        served = tmp_path / "served.mp4"
        served.write_bytes(r.content)
        pipe = load_pipeline("kiln-tiny")
        try:
            request = VideoRequest(prompt=JOB["prompt"], width=64, height=64, num_frames=9,
                                   num_inference_steps=STEPS, seed=JOB["seed"])
            frames = frames_to_uint8(pipe.generate(request)).numpy()
        finally:
            pipe.close()
        local, _ = write_outputs(frames, tmp_path / "local.mp4", fps=8)
        assert decoded(served).shape == (9, 64, 64, 3)
        assert np.array_equal(decoded(served), decoded(Path(local)))
        # Nothing else in the outputs: no temporary or partial file from the killed attempt.
        names = sorted(p.name for p in outputs.rglob("*") if p.is_file())
        assert not [n for n in names if n.startswith(".tmp-")], names
        assert len(names) == 2, names  # the video and its thumbnail
