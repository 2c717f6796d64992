"""Outages are weather: a worker group rides out Redis killed and back empty, and the database
refusing connections, with real servers and real worker processes. Every job ends once, none is
charged for the outage, and the queue moves again by itself once the server is back."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from faults import PrivateRedis, TcpProxy
from servers import Service, api_client, serving_api, worker_group
from sqlalchemy import make_url, select

from storage.outputs import checkpoint_key
from storage.tables import Job

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}
RECOVERY = 30  # seconds: the queue must move again within this of the server coming back




def _submit(client: httpx.Client, n: int, steps: int, tag: str, size: int = 64) -> list[str]:
    ids = []
    for i in range(n):
        r = client.post("/v1/jobs", json={**JOB, "prompt": f"{tag} {i}", "seed": i,
                                           "num_inference_steps": steps, "width": size,
                                           "height": size})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def _rows(service: Service, ids: list[str]) -> list[Job]:
    with service.db.session() as s:
        rows = list(s.scalars(select(Job).where(Job.id.in_(ids))))
        s.expunge_all()
    return rows


def _wait_all(service: Service, ids: list[str], group: Any, timeout: float) -> list[Job]:
    deadline = time.monotonic() + timeout
    while True:
        assert group.poll() is None, f"the worker group exited with {group.returncode}"
        rows = _rows(service, ids)
        if all(r.state not in ("queued", "running") for r in rows):
            return rows
        assert time.monotonic() < deadline, sorted((r.state, r.id) for r in rows)
        time.sleep(0.2)


def _group_state(client: httpx.Client, state: str, timeout: float = 10) -> str | None:
    """Waits until the one worker group reports ``state``; its reason."""
    deadline = time.monotonic() + timeout
    while True:
        [group] = client.get("/v1/workers").json()["data"]
        if group["state"] == state:
            return group["reason"]
        assert time.monotonic() < deadline, group
        time.sleep(0.2)


def _rendered_once_and_uncharged(rows: list[Job]) -> None:
    assert {r.state for r in rows} == {"succeeded"}, [(r.id, r.state, r.error) for r in rows]
    assert all((r.attempts, r.uncharged_attempts) == (1, 0) for r in rows), [
        (r.id, r.attempts, r.uncharged_attempts) for r in rows]


@pytest.mark.chaos  # slow (a 10 s outage): `make chaos` runs it, `make test` does not
def test_redis_killed_for_10_s_and_back_empty_the_group_carries_on(
        db: Any, redis_prefix: str, tmp_path: Path) -> None:
    with PrivateRedis(tmp_path / "redis") as server, \
            redis.Redis.from_url(server.url, socket_timeout=5) as private, \
            serving_api(db, private, redis_prefix, tmp_path, users=("alice",),
                        redis_url=server.url) as service, \
            worker_group(service, dp=2) as group, api_client(service) as client:
        before = _submit(client, 4, 30, "before")
        _wait_all(service, before, group, timeout=60)

        server.kill()
        killed = time.monotonic()
        during = _submit(client, 4, 30, "during")  # the rows are the truth; Redis is an index
        # The group says what is wrong while it waits.
        assert "Redis is unreachable" in (_group_state(client, "degraded") or "")
        time.sleep(max(0.0, 10 - (time.monotonic() - killed)))
        assert group.poll() is None, "the group survived the outage"
        server.start()  # empty: no index, no scripts, no wake tokens
        back = time.monotonic()
        rows = _wait_all(service, before + during, group, timeout=RECOVERY)
        assert time.monotonic() - back < RECOVERY
        _rendered_once_and_uncharged(rows)
        assert _group_state(client, "ready") is None


def _until(what: Any, timeout: float, group: Any) -> float:
    """Waits until ``what()``; the seconds it took."""
    began = time.monotonic()
    while not what():
        assert group.poll() is None, f"the worker group exited with {group.returncode}"
        assert time.monotonic() - began < timeout, "timed out"
        time.sleep(0.1)
    return time.monotonic() - began


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_the_database_refusing_connections_for_30_s_pauses_the_group_then_it_resumes(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    if db.backend != "postgresql":
        pytest.skip("a SQLite file cannot refuse connections")
    url = make_url(db.url)
    # The API marks a group stale once it has not reported for this long (60 s by default,
    # longer than the outage).
    stale = 10
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy, \
            serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                        worker_stale_seconds=stale) as service, \
            api_client(service) as client:
        proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(
            hide_password=False)
        # The worker reaches the database through the proxy; the API (on the test's own
        # engine) does not, so the jobs can be followed throughout.
        with worker_group(service, dp=2, database_url=proxied) as group:
            [group_id] = [g["id"] for g in client.get("/v1/workers").json()["data"]]
            ids = _submit(client, 6, 200, "outage", size=128)
            _until(lambda: any(r.state == "succeeded" for r in _rows(service, ids)), 60, group)
            proxy.refuse()
            refused = time.monotonic()
            seen = []
            while time.monotonic() - refused < 30:
                r = client.get("/v1/workers")
                assert r.status_code == 200, r.text  # the API's own database path is up
                [shown] = r.json()["data"]
                seen.append((round(time.monotonic() - refused), shown["state"], shown["stale"]))
                time.sleep(1)
            assert group.poll() is None, "the group survived the outage"
            # The group says it is degraded through the database it has lost, so /v1/workers
            # cannot show that while the outage lasts: it shows the group's last report going
            # stale. The group's own log names the database and says the claims pause.
            assert seen[-1][2] is True, seen
            log = capfd.readouterr().err
            sys.stderr.write(log)  # still shown if the test fails
            assert f"worker group {group_id}: the database is unreachable (" in log, log[-2000:]
            assert "claims pause" in log
            frozen = {r.id: (r.state, r.progress_step) for r in _rows(service, ids)}
            waiting = [j for j, (state, _) in frozen.items() if state == "queued"]
            assert waiting, "the outage held claims back"
            proxy.accept()
            back = time.monotonic()
            # The queue moves again by itself: steps and final transitions land, then claims.
            assert _until(lambda: {r.id: (r.state, r.progress_step)
                                   for r in _rows(service, ids)} != frozen,
                          RECOVERY, group) < RECOVERY
            assert _until(lambda: any(r.state != "queued" for r in _rows(service, waiting)),
                          RECOVERY, group) < RECOVERY
            rows = _wait_all(service, ids, group, timeout=RECOVERY + 30)
            # Six jobs of ~2 s each on two ranks: most of the recovery window is rendering.
            assert time.monotonic() - back < RECOVERY + 30
            assert _group_state(client, "ready") is None
            [shown] = client.get("/v1/workers").json()["data"]
            assert shown["stale"] is False
            log = capfd.readouterr().err
            sys.stderr.write(log)
            assert f"worker group {group_id}: the servers answer again; claims resume" in log
        _rendered_once_and_uncharged(rows)


# A job long enough to run through a 10 s outage: kiln-tiny at 256x256, 9 frames, ~0.13 s a
# step on a CPU rank: ~25 s in all, checkpointed every 10 steps (~1.3 s apart).
THROUGH = {**JOB, "prompt": "through the outage", "width": 256, "height": 256, "seed": 3,
           "num_inference_steps": 200}
CHECKPOINT_EVERY = 10


# The database's case in `make test` (Redis killed mid-render is shown above); Redis's in
# `make chaos` as well.
@pytest.mark.chaos  # slow (a 10 s outage mid-render, each server): `make chaos` runs both
@pytest.mark.parametrize("server", ["redis", "database"])
def test_a_job_rendering_through_a_10_s_outage_keeps_checkpointing_and_ends_once(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, server: str) -> None:
    """Checkpoints go to the output store, not to the server that is out: they go on being
    written through a 10 s outage of Redis or of the database, the job is not failed by it, and
    it ends once, uncharged, its checkpoint deleted."""
    if server == "database" and db.backend != "postgresql":
        pytest.skip("a SQLite file cannot refuse connections")
    url = make_url(db.url)
    with contextlib.ExitStack() as stack:
        overrides: dict[str, Any] = {}
        if server == "redis":
            private = stack.enter_context(PrivateRedis(tmp_path / "redis"))
            client_redis = stack.enter_context(
                redis.Redis.from_url(private.url, socket_timeout=5))
            overrides["redis_url"] = private.url
        else:
            proxy = stack.enter_context(TcpProxy(url.host or "127.0.0.1", url.port or 5432))
            client_redis = redis_client
        service = stack.enter_context(serving_api(db, client_redis, redis_prefix, tmp_path,
                                                  users=("alice",), **overrides))
        worker_overrides = {"checkpoint_every_steps": CHECKPOINT_EVERY,
                            "checkpoint_every_seconds": 0}
        if server == "database":
            # The worker reaches the database through the proxy; the test does not.
            worker_overrides["database_url"] = url.set(
                host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        group = stack.enter_context(worker_group(service, dp=1, **worker_overrides))
        client = stack.enter_context(api_client(service))
        r = client.post("/v1/jobs", json=THROUGH)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        checkpoint = Path(service.settings.output_dir) / checkpoint_key(job_id)
        _until(lambda: checkpoint.exists(), 60, group)
        (private.kill if server == "redis" else proxy.refuse)()
        out = time.monotonic()
        written = {checkpoint.stat().st_mtime_ns}
        while time.monotonic() - out < 10:
            if checkpoint.exists():
                written.add(checkpoint.stat().st_mtime_ns)
            time.sleep(0.2)
        assert group.poll() is None, "the group survived the outage"
        (private.start if server == "redis" else proxy.accept)()
        [row] = _wait_all(service, [job_id], group, timeout=60)
        # The checkpoints kept coming while the server was out (one every ~1.3 s).
        assert len(written) >= 3, written
    _rendered_once_and_uncharged([row])
    assert not checkpoint.exists(), "the checkpoint outlives its job"
