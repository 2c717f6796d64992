"""The worker group against real servers: a job that cannot run fails alone, a running job is
cancelled within a step, and the group keeps rendering the others; a running kiln-tiny job has a
preview frame while it runs."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from servers import Service, api_client, running_service, wait_job
from sqlalchemy import select

from scheduler import queue_index
from storage import submission
from storage.outputs import preview_key
from storage.tables import User

# A whole worker group: on PostgreSQL only in `make test` (tests/conftest.py).
pytestmark = pytest.mark.group

JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with running_service(db, redis_client, redis_prefix, tmp_path, users=["alice"]) as svc:
        yield svc






def test_job_the_model_cannot_run_fails_with_a_reason_and_the_group_renders_the_rest(
        service: Service, redis_client: Any) -> None:
    # 8 frames passes no API (the VAE needs 1 + 4k); stored directly, it reaches the worker.
    with service.db.session() as s:
        alice = s.scalars(select(User).where(User.name == "alice")).one()
        spec = submission.JobSpec(model="kiln-tiny", prompt="eight frames", width=64, height=64,
                                  num_frames=8, fps=8, num_inference_steps=2, guidance_scale=5.0)
        bad = submission.create_job(s, alice, spec, request_hash="x" * 64).job
        queue_index.add(redis_client, service.settings.redis_prefix, [bad])
    with api_client(service) as client:
        good = client.post("/v1/jobs", json={**JOB, "prompt": "fine", "num_inference_steps": 2})
        assert good.status_code == 201
        failed = wait_job(client, bad.id, lambda j: j["status"] not in ("queued", "running"))
        assert failed["status"] == "failed"
        assert "could not start" in failed["error"]["message"] and "1 + 4k" in failed["error"][
            "message"]
        done = wait_job(client, good.json()["id"], lambda j: j["status"] == "succeeded")
        assert done["progress"] == 1.0


def test_cancel_of_a_running_job_stops_it_within_one_step(service: Service) -> None:
    with api_client(service) as client:
        r = client.post("/v1/jobs", json={**JOB, "prompt": "a long one",
                                           "num_inference_steps": 200})
        job_id = r.json()["id"]
        running = wait_job(client, job_id, lambda j: j["status"] == "running" and j["step"] >= 2)
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        asked_at = client.get(f"/v1/jobs/{job_id}").json()["step"]
        cancelled = wait_job(client, job_id, lambda j: j["status"] == "cancelled", timeout=30)
        # The rank saw the flag at the next step boundary: at most one more step ran (plus the
        # one that may have been in flight while the request was written).
        assert running["step"] <= cancelled["step"] <= asked_at + 2
        assert cancelled["step"] < 200
        # The group is free again: a new job runs to the end.
        r = client.post("/v1/jobs", json={**JOB, "prompt": "next", "num_inference_steps": 2})
        wait_job(client, r.json()["id"], lambda j: j["status"] == "succeeded")


def test_a_running_kiln_tiny_job_shows_a_preview_every_few_steps_gone_when_it_ends(
        service: Service) -> None:
    assert service.settings.preview_every_steps == 2
    with api_client(service) as client:
        r = client.post("/v1/jobs", json={**JOB, "prompt": "a long one",
                                           "num_inference_steps": 200})
        job_id = r.json()["id"]
        wait_job(client, job_id, lambda j: j["status"] == "running" and j["step"] >= 4)
        deadline = time.monotonic() + 30
        while (preview := client.get(f"/v1/jobs/{job_id}/preview")).status_code == 404:
            assert time.monotonic() < deadline, preview.text
            time.sleep(0.05)
        assert preview.status_code == 200 and preview.headers["cache-control"] == "no-store"
        step, total = map(int, preview.headers["kiln-preview-step"].split("/"))
        assert step % 2 == 0 and 2 <= step < total == 200
        with Image.open(io.BytesIO(preview.content)) as image:
            assert (image.format, image.size, image.mode) == ("PNG", (64, 64), "RGB")
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        wait_job(client, job_id, lambda j: j["status"] == "cancelled", timeout=30)
        assert client.get(f"/v1/jobs/{job_id}/preview").status_code == 404
        # The leader's preview thread deletes it once the job has ended.
        deadline = time.monotonic() + 10
        while service.store.exists(preview_key(job_id)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
