"""The whole path: HTTP submissions -> database + Redis -> a worker group -> videos.

Real servers only: the API on a real socket (uvicorn), the real Redis, the real database on both
backends, and a ``kiln worker`` in its own process group of CPU ranks sharing the weights, at two
layouts: ``--dp 2`` (two replicas of one rank) and ``--dp 1 --sp 2`` (one replica whose two
ranks split each job's token sequence).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from servers import Service, decoded, running_service
from sqlalchemy import select

from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline
from runtime.sequence import Layout
from storage.tables import Job
from storage.video import write_outputs

# A whole worker group: on PostgreSQL only in `make test` (tests/conftest.py).
pytestmark = pytest.mark.group

JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4, "fps": 8}


@pytest.fixture(params=[Layout(dp=2), Layout(dp=1, sp=2)], ids=["dp2", "dp1xsp2"])
def layout(request: pytest.FixtureRequest) -> Layout:
    return request.param


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path,
            layout: Layout) -> Iterator[Service]:
    with running_service(db, redis_client, redis_prefix, tmp_path, dp=layout.dp,
                         sp=layout.sp) as svc:
        yield svc


def test_six_jobs_from_two_users_render_on_every_replica_and_match_kiln_render(
        service: Any, layout: Layout, tmp_path: Path) -> None:
    url, keys, db = service.url, service.keys, service.db
    specs = [("alice" if i % 2 else "bob", {**JOB, "prompt": f"shape number {i}", "seed": 100 + i})
             for i in range(6)]

    def submit(spec: tuple[str, dict[str, Any]]) -> tuple[str, str]:
        who, body = spec
        r = httpx.post(f"{url}/v1/jobs", json=body,
                       headers={"Authorization": f"Bearer {keys[who]}"}, timeout=30)
        assert r.status_code == 201, r.text
        return who, r.json()["id"]

    with ThreadPoolExecutor(max_workers=6) as pool:  # all six at once
        submitted = list(pool.map(submit, specs))

    seen_states: dict[str, set[str]] = {job_id: set() for _, job_id in submitted}
    deadline = time.monotonic() + 240
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            done = 0
            for who, job_id in submitted:
                r = client.get(f"/v1/jobs/{job_id}",
                               headers={"Authorization": f"Bearer {keys[who]}"})
                assert r.status_code == 200, r.text
                body = r.json()
                seen_states[job_id].add(body["status"])
                assert body["status"] not in ("failed", "dead", "cancelled"), body
                done += body["status"] == "succeeded"
            if done == len(submitted):
                break
            assert time.monotonic() < deadline, f"not all jobs finished: {seen_states}"
            time.sleep(0.2)

        # Neither user sees the other's jobs.
        for who, other in (("alice", "bob"), ("bob", "alice")):
            mine = {j for w, j in submitted if w == who}
            listed = client.get("/v1/jobs", headers={"Authorization": f"Bearer {keys[who]}"})
            assert {j["id"] for j in listed.json()["data"]} == mine
            for w, job_id in submitted:
                if w == other:
                    r = client.get(f"/v1/jobs/{job_id}",
                                   headers={"Authorization": f"Bearer {keys[who]}"})
                    assert r.status_code == 404

        # Each video equals what `kiln render` makes for the same request and seed.
        pipe = load_pipeline("kiln-tiny")
        try:
            for (who, job_id), (_, body) in zip(submitted, specs, strict=True):
                r = client.get(f"/v1/jobs/{job_id}/video",
                               headers={"Authorization": f"Bearer {keys[who]}"})
                assert r.status_code == 200
                served = tmp_path / f"{job_id}.mp4"
                served.write_bytes(r.content)
                request = VideoRequest(prompt=body["prompt"], width=64, height=64, num_frames=9,
                                       num_inference_steps=4, seed=body["seed"])
                frames = frames_to_uint8(pipe.generate(request)).numpy()
                local, _ = write_outputs(frames, tmp_path / f"local-{job_id}.mp4", fps=8)
                assert np.array_equal(decoded(served), decoded(Path(local))), job_id
                assert decoded(served).shape == (9, 64, 64, 3)
        finally:
            pipe.close()

    with db.session() as s:
        ranks = {s.scalar(select(Job.rank).where(Job.id == job_id)) for _, job_id in submitted}
    # Every replica rendered jobs, each recorded under its first rank (the one that stores it).
    assert ranks == set(layout.leaders), ranks
    assert all("running" in states or "succeeded" in states for states in seen_states.values())


@pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning")
def test_openai_sdk_creates_polls_until_completed_and_downloads_a_rendered_video(
        service: Any, tmp_path: Path) -> None:
    import openai

    url, keys = service.url, service.keys
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["alice"], max_retries=0, timeout=30)
    video = client.videos.create(prompt="a red circle moving left", model="kiln-tiny",
                                 size="64x64", seconds="1",  # type: ignore[arg-type]
                                 extra_body={"num_inference_steps": 4, "seed": 3})
    seen = [video.status]
    deadline = time.monotonic() + 120
    while video.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)
        video = client.videos.retrieve(video.id)
        seen.append(video.status)
    assert video.status == "completed" and video.progress == 100, (video, seen)
    path = tmp_path / "sdk.mp4"
    client.videos.download_content(video.id).write_to_file(path)
    frames = decoded(path)
    assert frames.shape[1:] == (64, 64, 3) and frames.shape[0] >= 8
    thumb = client.videos.download_content(video.id, variant="thumbnail")
    assert thumb.read()[:8] == b"\x89PNG\r\n\x1a\n"
