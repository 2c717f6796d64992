"""`kiln up` on embedded defaults: a private Redis, SQLite, the API and a worker group, from an
empty directory; a job submitted over HTTP renders and its MP4 downloads and decodes, with the
group at ``--dp 2`` and at ``--dp 1 --sp 2`` (one replica of two ranks). Started again, it keeps
its one admin key, until asked to rotate it. With its Celery side work, every webhook it sends
is signed with the owner's secret."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import av
import httpx
import pytest
from servers import KILN, Receiver, kiln_up, up_env
from standardwebhooks import Webhook


def _decoded_frames(path: Path) -> list[Any]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_kiln_up_from_an_empty_directory_renders_a_submitted_job(tmp_path: Path) -> None:
    with kiln_up(tmp_path, "--dp", "2") as (base, key):
        headers = {"Authorization": f"Bearer {key}"}
        body = {"prompt": "a red circle moving left", "width": 64, "height": 64,
                "num_frames": 9, "num_inference_steps": 4, "seed": 7}
        created = httpx.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        states = []
        deadline = time.monotonic() + 240
        while not states or states[-1] not in ("succeeded", "failed", "dead"):
            assert time.monotonic() < deadline, states
            states.append(httpx.get(f"{base}/v1/jobs/{job_id}", headers=headers,
                                    timeout=30).json()["status"])
            time.sleep(0.1)
        assert states[-1] == "succeeded", states
        assert states[0] in ("queued", "running")
        video = httpx.get(f"{base}/v1/jobs/{job_id}/video", headers=headers, timeout=30)
        assert video.status_code == 200
        path = tmp_path / "out.mp4"
        path.write_bytes(video.content)
        frames = _decoded_frames(path)
        assert len(frames) == 9 and frames[0].shape == (64, 64, 3)


@pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning")
def test_kiln_up_at_dp1_sp2_renders_an_sdk_job_on_one_replica_of_two_ranks(
        tmp_path: Path) -> None:
    import openai

    # --goal reaches the worker (throughput: not the default at sp=2).
    with kiln_up(tmp_path, "--dp", "1", "--sp", "2", "--goal", "throughput") as (base, key):
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        video = sdk.videos.create(prompt="a red circle moving left", model="kiln-tiny",
                                  size="64x64", seconds="1",  # type: ignore[arg-type]
                                  extra_body={"num_inference_steps": 4, "seed": 7})
        seen = [video.status]
        deadline = time.monotonic() + 240  # the worker group loads its model meanwhile
        while video.status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
            video = sdk.videos.retrieve(video.id)
            seen.append(video.status)
        assert video.status == "completed" and video.progress == 100, (video, seen)
        path = tmp_path / "sdk.mp4"
        sdk.videos.download_content(video.id).write_to_file(path)
        frames = _decoded_frames(path)
        assert len(frames) >= 8 and frames[0].shape == (64, 64, 3)

        groups = httpx.get(f"{base}/v1/workers", headers={"Authorization": f"Bearer {key}"},
                           timeout=30).json()["data"]
        assert len(groups) == 1, groups
        group = groups[0]
        assert (group["dp_size"], group["sp_size"], group["world_size"]) == (1, 2, 2), group
        assert group["goal"] == "throughput", group
        assert [(r["replica"], r["ranks"]) for r in group["replicas"]] == [(0, [0, 1])], group
        assert [(r["rank"], r["replica"]) for r in group["ranks"]] == [(0, 0), (1, 0)], group



def _admin_keys(cwd: Path) -> list[list[str]]:
    """(prefix, state) of each admin key, from `kiln keys list` in ``cwd``."""
    listed = subprocess.run([KILN, "keys", "list"], cwd=cwd, env=up_env(), capture_output=True,
                            text=True, check=True).stdout
    return [[w[0], w[3]] for w in map(str.split, listed.splitlines()) if w[2] == "admin"]


def test_kiln_up_keeps_one_admin_key_across_starts_and_rotates_it_when_asked(
        tmp_path: Path) -> None:
    key_file = tmp_path / "var" / "admin.key"
    keys = []
    for _ in range(3):
        with kiln_up(tmp_path, "--dp", "1") as (base, key):
            assert key_file.stat().st_mode & 0o777 == 0o600
            assert httpx.get(f"{base}/v1/summary", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code == 200
        keys.append(key)
    assert keys[0] == keys[1] == keys[2]
    assert _admin_keys(tmp_path) == [[keys[0][5:17], "active"]]

    with kiln_up(tmp_path, "--dp", "1", "--rotate-admin-key") as (base, new):
        assert new != keys[0] and key_file.stat().st_mode & 0o777 == 0o600
        for key, status in ((new, 200), (keys[0], 401)):
            assert httpx.get(f"{base}/v1/summary", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code == status
    assert _admin_keys(tmp_path) == [[keys[0][5:17], "revoked"], [new[5:17], "active"]]


def test_every_delivery_under_kiln_up_carries_a_webhook_signature_of_its_owner(
        tmp_path: Path) -> None:
    job = {"prompt": "a red circle moving left", "width": 64, "height": 64, "num_frames": 9,
           "num_inference_steps": 2, "seed": 7}
    with Receiver() as receiver, kiln_up(tmp_path, "--dp", "1", celery=True) as (base, key):
        headers = {"Authorization": f"Bearer {key}"}
        events = ["job.started", "job.progress", "job.succeeded"]
        created = httpx.post(f"{base}/v1/jobs", headers=headers, timeout=30, json={
            **job, "webhook_url": receiver.url, "webhook_events": events})
        assert created.status_code == 201, created.text
        batch = httpx.post(f"{base}/v1/batches", headers=headers, timeout=30, json={
            "jobs": [job], "webhook_url": receiver.url})
        assert batch.status_code == 201, batch.text
        secret = httpx.get(f"{base}/v1/webhook-secret", headers=headers,
                           timeout=30).json()["secret"]
        deadline = time.monotonic() + 240
        while not {"job.succeeded", "batch.completed"} <= {
                r.headers.get("Kiln-Event") for r in receiver.requests}:
            assert time.monotonic() < deadline, [r.headers for r in receiver.requests]
            time.sleep(0.5)
    got = receiver.requests
    kinds = [r.headers["Kiln-Event"] for r in got]
    assert {"job.started", "job.succeeded", "batch.completed"} <= set(kinds), kinds
    for r in got:
        assert r.headers["webhook-signature"].startswith("v1,"), r.headers
        assert Webhook(secret).verify(r.body, r.headers)["type"] == r.headers["Kiln-Event"]
