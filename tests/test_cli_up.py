"""`kiln up` on embedded defaults: a private Redis, SQLite, the API and a worker group, from an
empty directory; a job submitted over HTTP renders and its MP4 downloads and decodes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import av
import httpx
from servers import KILN

from common.procs import free_port, stop_group


def test_kiln_up_from_an_empty_directory_renders_a_submitted_job(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KILN_") and k not in ("REDIS_URL", "DATABASE_URL")}
    env["KILN_API_PORT"] = str(port)
    proc = subprocess.Popen([KILN, "up", "--dp", "2", "--no-celery"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        key_file = tmp_path / "var" / "admin.key"
        deadline = time.monotonic() + 120
        while not key_file.exists() or not _ok(f"{base}/healthz"):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "kiln up did not come up"
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
        body = {"prompt": "a red circle moving left", "width": 64, "height": 64,
                "num_frames": 9, "num_inference_steps": 4, "seed": 7}
        created = httpx.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        states = []
        while not states or states[-1] not in ("succeeded", "failed", "dead"):
            assert time.monotonic() < deadline + 120, states
            states.append(httpx.get(f"{base}/v1/jobs/{job_id}", headers=headers,
                                    timeout=30).json()["status"])
            time.sleep(0.1)
        assert states[-1] == "succeeded", states
        assert states[0] in ("queued", "running")
        video = httpx.get(f"{base}/v1/jobs/{job_id}/video", headers=headers, timeout=30)
        assert video.status_code == 200
        path = tmp_path / "out.mp4"
        path.write_bytes(video.content)
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape == (64, 64, 3)
    finally:
        stop_group(proc, timeout=90)
        if proc.stdout:
            proc.stdout.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
