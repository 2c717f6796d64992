"""The overnight batch, end to end: a JSONL of 20 jobs uploaded with a window that opens a few
seconds later, rendered by a real ``kiln worker --dp 2``; nothing starts before the window opens,
every job succeeds, and the morning report agrees with the job rows.

Real servers only: the API on a real socket (uvicorn), the real Redis, the real database on both
backends, and the worker group in its own process group of CPU ranks sharing the weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import running_service
from sqlalchemy import select

from storage.tables import Job

# A whole worker group: on PostgreSQL only in `make test` (tests/conftest.py).
pytestmark = pytest.mark.group

NUM_JOBS = 20
DEFAULTS = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}
OPENS_AFTER_SECONDS = 4.0


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str,
            tmp_path: Path) -> Iterator[tuple[httpx.Client, Any]]:
    with running_service(db, redis_client, redis_prefix, tmp_path, users=["night-owl"]) as svc, \
            httpx.Client(base_url=svc.url, timeout=30,
                         headers={"Authorization": f"Bearer {svc.keys['night-owl']}"}) as client:
        yield client, db


def test_overnight_batch_waits_for_its_window_then_renders_all_and_reports_them(
        service: Any) -> None:
    client, db = service
    lines = "\n".join(json.dumps({"prompt": f"shape number {i}", "seed": 1000 + i,
                                  "num_inference_steps": 2 + i % 3})
                      for i in range(NUM_JOBS))
    opens = datetime.now(UTC) + timedelta(seconds=OPENS_AFTER_SECONDS)
    closes = opens + timedelta(minutes=30)
    r = client.post("/v1/batches", files={"file": ("night.jsonl", lines.encode())},
                    data={"defaults": json.dumps(DEFAULTS), "name": "e2e night",
                          "not_before": opens.isoformat(), "deadline": closes.isoformat()})
    assert r.status_code == 201, r.text
    batch_id = r.json()["id"]

    # Before the window opens: every job waits, none is claimed.
    polls_before = 0
    while datetime.now(UTC) < opens - timedelta(seconds=0.3):
        batch = client.get(f"/v1/batches/{batch_id}").json()
        assert batch["counts"]["queued"] == NUM_JOBS, batch["counts"]
        assert batch["status"] == "queued" and batch["started_at"] is None
        polls_before += 1
        time.sleep(0.2)
    assert polls_before >= 5

    deadline = time.monotonic() + 180
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        bad = {s: batch["counts"][s] for s in ("failed", "dead", "cancelled", "expired")}
        assert not any(bad.values()), batch
        if batch["status"] == "finished":
            break
        assert time.monotonic() < deadline, f"the batch did not finish: {batch['counts']}"
        time.sleep(0.25)
    assert batch["progress"] == {"finished": NUM_JOBS, "total": NUM_JOBS, "fraction": 1.0,
                                 "step_fraction": 1.0}

    report = client.get(f"/v1/batches/{batch_id}/report").json()
    with db.session() as s:
        rows = list(s.scalars(select(Job).where(Job.batch_id == batch_id)
                              .order_by(Job.batch_index)))
    assert len(rows) == NUM_JOBS
    assert {j.state for j in rows} == {"succeeded"}
    assert all(j.started_at is not None and j.started_at >= opens for j in rows), \
        [(j.id, j.started_at) for j in rows if j.started_at and j.started_at < opens]
    assert {j.rank for j in rows} == {0, 1}, "both ranks rendered jobs"

    first_start = min(j.started_at for j in rows if j.started_at)
    last_finish = max(j.finished_at for j in rows if j.finished_at)
    active = (last_finish - first_start).total_seconds()
    render_seconds = sum(j.render_seconds or 0.0 for j in rows)
    assert report["counts"]["succeeded"] == NUM_JOBS and report["num_jobs"] == NUM_JOBS
    assert sum(report["counts"].values()) == NUM_JOBS and report["problems"] == []
    assert datetime.fromisoformat(report["started_at"]) == first_start
    assert datetime.fromisoformat(report["finished_at"]) == last_finish
    assert datetime.fromisoformat(report["not_before"]) == opens
    assert report["active_seconds"] == round(active, 3)
    assert report["videos_per_hour"] == round(NUM_JOBS / (active / 3600), 2)
    assert report["total_render_seconds"] == pytest.approx(render_seconds, abs=1e-3)
    # Two ranks render side by side, so the summed render time exceeds the active span.
    assert render_seconds > active > 0
    assert [j["line"] for j in report["jobs"]] == list(range(1, NUM_JOBS + 1))
    for entry, row in zip(report["jobs"], rows, strict=True):
        assert entry["id"] == row.id and entry["video_url"] == f"/v1/jobs/{row.id}/video"
        assert entry["thumbnail_url"] == f"/v1/jobs/{row.id}/thumbnail"
    video = client.get(report["jobs"][0]["video_url"])
    assert video.status_code == 200 and video.headers["content-type"] == "video/mp4"
    assert len(video.content) > 0
