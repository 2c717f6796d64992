"""Dead ranks come back, with real servers and real worker processes: a rank killed outright is
replaced by a new rank set at once, only the job it was rendering is charged, and a job that
crashes its rank every time ends dead with the reason while the group serves the others."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Service, api_client, serving_api, worker_group
from sqlalchemy import select

from storage import queries
from storage.tables import Job

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

# ~3 s of rendering each on a CPU rank of a dp=2 group: both ranks are busy when one is killed.
JOB = {"model": "kiln-tiny", "width": 128, "height": 128, "num_frames": 9, "fps": 8,
       "num_inference_steps": 150}




def _submit(client: httpx.Client, n: int, tag: str) -> list[str]:
    ids = []
    for i in range(n):
        r = client.post("/v1/jobs", json={**JOB, "prompt": f"{tag} {i}", "seed": i})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def _ready_group(client: httpx.Client, not_in: set[str], timeout: float = 90) -> dict[str, Any]:
    """The worker group that reports ready and is not one of ``not_in``."""
    deadline = time.monotonic() + timeout
    while True:
        groups = [g for g in client.get("/v1/workers").json()["data"]
                  if g["state"] == "ready" and g["id"] not in not_in]
        if groups:
            return groups[0]
        assert time.monotonic() < deadline, "no new group reported ready"
        time.sleep(0.2)


def _rank_of(client: httpx.Client, group_id: str, job_id: str,
             timeout: float = 60) -> dict[str, Any]:
    """The rank of ``group_id`` rendering ``job_id``, once it is (as the group reports it)."""
    deadline = time.monotonic() + timeout
    while True:
        for g in client.get("/v1/workers").json()["data"]:
            for r in g["ranks"] if g["id"] == group_id else []:
                if r["job_id"] == job_id and r.get("pid"):
                    return r
        assert time.monotonic() < deadline, f"{job_id} never ran on {group_id}"
        time.sleep(0.1)


def _rows(service: Service, ids: list[str]) -> dict[str, Job]:
    with service.db.session() as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
        s.expunge_all()
    return rows


def _wait_final(service: Service, ids: list[str], launcher: Any,
                timeout: float) -> dict[str, Job]:
    deadline = time.monotonic() + timeout
    while True:
        assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}"
        rows = _rows(service, ids)
        if all(r.state not in ("queued", "running") for r in rows.values()):
            return rows
        assert time.monotonic() < deadline, {i: r.state for i, r in rows.items()}
        time.sleep(0.2)


# Rank 1's case in `make test`; rank 0's (the coordinator's own rank) in `make chaos` as well.
@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.chaos), 1],
                         ids=["rank0", "rank1"])
def test_a_killed_rank_is_replaced_and_only_its_job_is_charged(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, victim: int) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client, worker_group(service, dp=2) as launcher:
        first = _ready_group(client, set())
        a, b = _submit(client, 2, "pair")
        ranks = {job: _rank_of(client, first["id"], job)["rank"] for job in (a, b)}
        hit = next(j for j, r in ranks.items() if r == victim)
        spared = a if hit == b else b
        pid = _rank_of(client, first["id"], hit)["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        second = _ready_group(client, {first["id"]})
        assert time.monotonic() - killed < 30, "a new rank set within 30 s"
        rows = _wait_final(service, [a, b], launcher, timeout=120)
    assert {r.state for r in rows.values()} == {"succeeded"}
    # The killed rank's job was charged for its attempt; the other one was handed back free.
    assert (rows[hit].attempts, rows[hit].uncharged_attempts) == (2, 0)
    assert (rows[spared].attempts, rows[spared].uncharged_attempts) == (2, 1)
    with service.db.session() as s:
        ends = {j: [(e.kind, e.detail.get("code"), e.detail.get("charged"))
                    for e in queries.job_events(s, j) if e.kind == "requeued"] for j in (a, b)}
    assert ends[hit] == [("requeued", "rank_crashed", True)]
    assert ends[spared] == [("requeued", "group_failed", False)]
    assert second["id"] != first["id"]


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_job_that_crashes_its_rank_every_time_ends_dead_and_the_rest_render(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client, worker_group(service, dp=2) as launcher:
        [poison] = _submit(client, 1, "poison")
        others = _submit(client, 3, "fine")
        seen: set[str] = set()
        # The crash the job causes, played by the test: whichever rank renders it dies.
        for _ in range(service.settings.max_attempts):
            group = _ready_group(client, seen)
            seen.add(group["id"])
            os.kill(_rank_of(client, group["id"], poison)["pid"], signal.SIGKILL)
        rows = _wait_final(service, [poison, *others], launcher, timeout=180)
    assert rows[poison].state == "dead"
    assert "crashed while rendering it" in (rows[poison].error or "")
    assert rows[poison].attempts - rows[poison].uncharged_attempts == 3
    assert all(rows[j].state == "succeeded" for j in others), {j: rows[j].state for j in others}
    # Every other job was charged only for attempts that ended well: none lost one to the
    # poison job's crashes.
    assert all(rows[j].attempts - rows[j].uncharged_attempts == 1 for j in others)


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_killed_launcher_leaves_ranks_that_hand_their_jobs_back_uncharged(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client:
        with worker_group(service, dp=2, args=["--drain-seconds", "1"]) as launcher:
            first = _ready_group(client, set())
            ids = _submit(client, 2, "orphaned")
            pids = [_rank_of(client, first["id"], j)["pid"] for j in ids]
            launcher.kill()  # SIGKILL: nothing of the launcher runs again
            launcher.wait(timeout=10)
            # Its ranks are told by the kernel (SIGTERM on their parent's death): they drain
            # and hand the jobs back, then leave.
            deadline = time.monotonic() + 30
            while any(_alive(pid) for pid in pids):
                assert time.monotonic() < deadline, "the orphaned ranks did not leave"
                time.sleep(0.2)
            rows = _rows(service, ids)
            assert {r.state for r in rows.values()} == {"queued"}
            assert all((r.attempts, r.uncharged_attempts) == (1, 1) for r in rows.values())
        # A supervisor starts a new group: it renders them, charged once each.
        with worker_group(service, dp=2) as second:
            rows = _wait_final(service, ids, second, timeout=120)
        assert {r.state for r in rows.values()} == {"succeeded"}
        assert all(r.attempts - r.uncharged_attempts == 1 for r in rows.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its parent) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
