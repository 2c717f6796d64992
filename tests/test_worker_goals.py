"""Pools by goal. The coordinator reports its group's goal and claims the class that goal
prefers; and two real worker groups on one database and Redis, a latency group
(``--dp 1 --sp 2 --goal latency``) and a throughput group (``--dp 2 --goal throughput``).
With both classes queued, the interactive job is rendered by the latency group and the batch
jobs by the throughput group; with one class alone, each group takes the other class's jobs too,
so no replica idles while work waits.

Each wave of jobs is made due at one instant (a shared ``not_before`` a moment ahead), so that
both groups find the whole wave queued and each claims what its goal prefers, up to its free
replicas (one and two): which group looks first does not change who gets what.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Service, api_client, job_row, serving_api, wait_job, worker_group

from common.families import TINY_MODEL
from common.settings import Settings
from kiln import group_io
from kiln.worker import WorkerConfig, make_coordinator
from runtime.sequence import Layout
from scheduler.policy import LATENCY, THROUGHPUT
from storage.workers import GroupReport

JOB = {"model": TINY_MODEL, "width": 64, "height": 64, "num_frames": 9, "fps": 8,
       "num_inference_steps": 8}
# Time to submit a wave before it is due; every POST of it must land within.
LEAD_SECONDS = 1.5


# ---- the coordinator: the goal it reports and claims by ---------------------------------------

@pytest.mark.parametrize(("layout", "goal", "serves", "prefer"), [
    (Layout(dp=2, sp=1), None, LATENCY, "interactive"),  # undeclared: interactive first
    (Layout(dp=1, sp=2), None, LATENCY, "interactive"),
    (Layout(dp=1, sp=2), THROUGHPUT, THROUGHPUT, "batch"),
    (Layout(dp=4, sp=1), LATENCY, LATENCY, "interactive"),
])
def test_a_group_reports_its_goal_and_claims_the_class_it_prefers(
        monkeypatch: pytest.MonkeyPatch, layout: Layout, goal: str | None, serves: str,
        prefer: str) -> None:
    asked: list[str] = []
    monkeypatch.setattr(group_io, "claim_for_group",
                        lambda *args, **kwargs: asked.append(kwargs["prefer"]) or [])
    reports: list[GroupReport] = []
    settings = Settings(_env_file=None, database_url="sqlite://",  # type: ignore[call-arg]
                        redis_url="redis://127.0.0.1:6379/0")
    coordinator = make_coordinator(settings, WorkerConfig(dp=layout.dp, sp=layout.sp, goal=goal),
                                   layout, "cpu", notify=lambda *_: None,
                                   report=lambda _, report: reports.append(report))
    try:
        coordinator.report([])
        assert coordinator._claim(list(layout.leaders)) == {}
    finally:
        coordinator.io.close()
    assert [r.goal for r in reports] == [serves]
    assert asked == [prefer]


def test_an_unknown_goal_is_refused() -> None:
    with pytest.raises(ValueError, match="goal"):
        WorkerConfig(goal="overnight")


# ---- two real groups --------------------------------------------------------------------------

@pytest.fixture
def pools(db: Any, redis_client: Any, redis_prefix: str,
          tmp_path: Path) -> Iterator[tuple[Service, dict[str, str]]]:
    """The API and both groups; yields the service and each goal's group id."""
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=["alice"]) as service, \
            worker_group(service, dp=1, sp=2, goal=LATENCY), \
            worker_group(service, dp=2, goal=THROUGHPUT):
        with api_client(service) as client:
            groups = client.get("/v1/workers").json()["data"]
        layouts = {g["goal"]: (g["dp_size"], g["sp_size"]) for g in groups}
        # Each group's goal as declared.
        assert layouts == {LATENCY: (1, 2), THROUGHPUT: (2, 1)}, groups
        yield service, {g["goal"]: g["id"] for g in groups}


def _wave(client: httpx.Client, classes: list[str]) -> dict[str, str]:
    """Jobs of ``classes``, all due at one instant; waits for them to end. Job id -> class."""
    due = datetime.now(UTC) + timedelta(seconds=LEAD_SECONDS)
    ids = {}
    for i, job_class in enumerate(classes):
        r = client.post("/v1/jobs", json={**JOB, "prompt": f"{job_class} {i}", "seed": i,
                                          "class": job_class, "not_before": due.isoformat()})
        assert r.status_code == 201, r.text
        ids[r.json()["id"]] = job_class
    assert datetime.now(UTC) < due, "the wave was not all queued before it was due"
    for job_id in ids:
        done = wait_job(client, job_id, lambda j: j["status"] not in ("queued", "running"),
                        timeout=60)
        assert done["status"] == "succeeded", done
    return ids


def _ran_on(service: Service, ids: dict[str, str], group_of: dict[str, str]) -> Counter[Any]:
    """(goal of the group that rendered it, class) -> jobs."""
    goal_of = {group_id: goal for goal, group_id in group_of.items()}
    return Counter((goal_of[job_row(service, job_id).worker_group_id], job_class)
                   for job_id, job_class in ids.items())


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_each_pool_takes_its_goals_class_first_and_the_other_class_when_its_own_is_absent(
        pools: tuple[Service, dict[str, str]]) -> None:
    service, group_of = pools
    with api_client(service) as client:
        # Both classes queued: interactive to the latency group, batch to the throughput group.
        mixed = _wave(client, ["batch", "interactive", "batch"])
        assert _ran_on(service, mixed, group_of) == {(LATENCY, "interactive"): 1,
                                                     (THROUGHPUT, "batch"): 2}
        # Only batch work queued: the latency group takes some of it too.
        night = _wave(client, ["batch"] * 3)
        assert _ran_on(service, night, group_of) == {(LATENCY, "batch"): 1,
                                                     (THROUGHPUT, "batch"): 2}
        # Only interactive work queued: the throughput group takes what the latency group's
        # one replica cannot.
        rush = _wave(client, ["interactive"] * 3)
        assert _ran_on(service, rush, group_of) == {(LATENCY, "interactive"): 1,
                                                    (THROUGHPUT, "interactive"): 2}
