"""`kiln batch submit / status / report` against the real API (uvicorn on a free port, real
Redis, both database backends), and the local-time window's conversion to UTC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from servers import Service, serving_api
from sqlalchemy import select

from kiln.cli.batch import parse_window
from storage import lifecycle
from storage.outputs import video_key
from storage.tables import Job

BERLIN = ZoneInfo("Europe/Berlin")


def test_window_is_the_next_start_and_the_end_after_it_in_utc() -> None:
    evening = datetime(2026, 7, 1, 18, 0, tzinfo=BERLIN)  # summer: UTC+2
    assert parse_window("22:00-06:00", evening, BERLIN) == (
        datetime(2026, 7, 1, 20, 0, tzinfo=UTC), datetime(2026, 7, 2, 4, 0, tzinfo=UTC))
    late = datetime(2026, 7, 1, 23, 0, tzinfo=BERLIN)  # already inside: the next one
    assert parse_window("22:00-06:00", late, BERLIN)[0] == datetime(2026, 7, 2, 20, 0,
                                                                    tzinfo=UTC)
    assert parse_window("1:30-4:00", evening, BERLIN) == (
        datetime(2026, 7, 1, 23, 30, tzinfo=UTC), datetime(2026, 7, 2, 2, 0, tzinfo=UTC))


def test_window_follows_daylight_saving_across_the_night() -> None:
    # Clocks go back at 03:00 on 25 October 2026: 22:00 is UTC+2, 06:00 is UTC+1.
    before = datetime(2026, 10, 24, 12, 0, tzinfo=BERLIN)
    assert parse_window("22:00-06:00", before, BERLIN) == (
        datetime(2026, 10, 24, 20, 0, tzinfo=UTC), datetime(2026, 10, 25, 5, 0, tzinfo=UTC))


@pytest.mark.parametrize("text", ["22:00", "25:00-06:00", "22:00-22:00", "10pm-6am"])
def test_window_refuses_what_is_not_start_end_clock_times(text: str) -> None:
    with pytest.raises(ValueError, match="22:00-06:00|same time"):
        parse_window(text)


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     redis_url="redis://unused", reconcile_interval_seconds=3600) as svc:
        yield svc


def _write(path: Path, *lines: dict[str, Any]) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_submit_with_a_window_then_status_and_report(service: Service, tmp_path: Path) -> None:
    file = _write(tmp_path / "night.jsonl", {"prompt": "one"}, {"prompt": "two", "seed": 4},
                  {"prompt": "three"})
    defaults = json.dumps({"width": 64, "height": 64, "num_frames": 9,
                           "num_inference_steps": 4})
    r = service.kiln("batch", "submit", str(file), "--window", "22:00-06:00", "--defaults",
                     defaults, "--name", "night")
    assert r.exit_code == 0, r.output
    batch_id = r.stdout.strip()
    expected = parse_window("22:00-06:00")
    with service.db.session() as s:
        rows = list(s.scalars(select(Job).where(Job.batch_id == batch_id)
                              .order_by(Job.batch_index)))
        assert [(j.prompt, j.class_, j.width) for j in rows] == [
            ("one", "batch", 64), ("two", "batch", 64), ("three", "batch", 64)]
        assert {(j.not_before, j.deadline) for j in rows} == {expected}
        # Finish one and fail one the way a worker would.
        for job, fail in ((rows[0], False), (rows[1], True)):
            claim = lifecycle.claim_job(s, job.id, worker_group_id="g", rank=0, lease_seconds=60,
                                        now=expected[0])
            assert claim is not None
            done_at = expected[0] + timedelta(seconds=10)
            if fail:
                lifecycle.fail_job(s, job.id, claim.attempt_token, error="out of device memory",
                                   now=done_at)
            else:
                service.store.put_bytes(video_key(job.id), b"an mp4 file")
                lifecycle.finish_succeeded(s, job.id, claim.attempt_token,
                                           video_key=video_key(job.id), now=done_at)
    status = service.kiln("batch", "status", batch_id)
    assert status.exit_code == 0, status.output
    assert "1 queued, 1 succeeded, 1 failed" in status.stdout
    assert "2/3 finished" in status.stdout and "name: night" in status.stdout
    report = service.kiln("batch", "report", batch_id)
    assert report.exit_code == 0, report.output
    assert "out of device memory" in report.stdout and rows[1].id in report.stdout
    assert "360 videos/hour" in report.stdout  # one video in the 10 s the batch was active
    everything = service.kiln("batch", "report", batch_id, "--jobs")
    assert f"{service.url}/v1/jobs/{rows[0].id}/video" in everything.stdout
    as_json = json.loads(service.kiln("batch", "report", batch_id, "--json").stdout)
    assert (as_json["counts"]["succeeded"], as_json["counts"]["failed"]) == (1, 1)


def test_a_bad_line_fails_with_the_line_and_field_and_exit_1(service: Service,
                                                              tmp_path: Path) -> None:
    file = _write(tmp_path / "bad.jsonl", {"prompt": "fine", "width": 64, "height": 64},
                  {"prompt": "bad", "width": 63, "height": 64})
    r = service.kiln("batch", "submit", str(file))
    assert r.exit_code == 1
    assert "line 2: width: must be a multiple of 16, got 63; nearest: 48 or 64" in r.stderr
    assert "(HTTP 422)" in r.stderr
    missing = service.kiln("batch", "status", "aaaaaaaaaaaaaaaaaaaa")
    assert missing.exit_code == 1 and "batch not found (HTTP 404)" in missing.stderr
