"""Replicas of two ranks (``--sp 2``): a replica's progress is reported once per step, by its
leader; a cancel ends the job on both of its ranks, and the replica takes the next job while
the other replica carries on; ``/v1/workers`` shows each replica's job while it runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from multirank import run_ranks
from servers import Service, api_client, job_row, running_service, wait_job

from common.families import TINY_MODEL
from runtime.pipelines.base import VideoRequest
from runtime.platform import get_platform
from runtime.rank_loop import (
    Ended,
    Progress,
    RankLoop,
    RankMessage,
    RankReport,
    Rendered,
    StepPlan,
    Ticket,
    run_loop,
)
from runtime.render import frames_to_uint8, load_pipeline
from runtime.sequence import Layout, open_sequence
from storage.video import write_outputs

# A whole worker group: on PostgreSQL only in `make test` (tests/conftest.py).
pytestmark = pytest.mark.group

JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}

# ---- the rank loop at dp=1 x sp=2, driven by a script -------------------------------------

LONG = VideoRequest(prompt="a long one", width=64, height=64, num_frames=9,
                    num_inference_steps=200, seed=1)
NEXT = VideoRequest(prompt="the next one", width=64, height=64, num_frames=5,
                    num_inference_steps=3, seed=2)
CANCEL_AFTER = 3  # steps of LONG before the cancel


def _row(m: RankMessage) -> dict[str, Any]:
    """A rank's message as a plain row: its job (None for a rank's own report), its step, and
    its outcome (None while the job runs; "rendered" before its files are stored)."""
    outcome = ("rendered" if isinstance(m, Rendered) else m.outcome if isinstance(m, Ended)
               else None)
    return {"rank": m.rank, "job_id": None if isinstance(m, RankReport) else m.job_id,
            "step": m.step if isinstance(m, Progress | Ended) else None, "outcome": outcome,
            "held": m.memory.get("job_id", "-") if isinstance(m, RankReport) and m.memory
            else "-"}


class ScriptedDriver:
    """Rank 0's driver: LONG on the replica, then a cancel of it after ``CANCEL_AFTER`` steps
    with NEXT given in the same plan; stops once NEXT is stored. Keeps every turn's messages,
    as rows."""

    def __init__(self) -> None:
        self.turns: list[list[dict[str, Any]]] = []
        self.sent_long = self.cancelled = self.done = False

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def next_plan(self, stop_requested: bool) -> StepPlan:
        if self.done:
            return StepPlan(stop=True)
        if not self.sent_long:
            self.sent_long = True
            return StepPlan(assign={0: Ticket(job_id="long", attempt_token="t1", request=LONG)},
                            step=True)
        steps = [st["step"] for turn in self.turns for st in turn
                 if st["job_id"] == "long" and st["outcome"] is None]
        if not self.cancelled and steps and steps[-1] >= CANCEL_AFTER:
            self.cancelled = True
            return StepPlan(drop={"long": "cancelled by the user"},
                            assign={0: Ticket(job_id="next", attempt_token="t2", request=NEXT)},
                            step=True)
        rendered = any(st["job_id"] == "next" and st["outcome"] == "rendered"
                       for turn in self.turns for st in turn)
        return StepPlan(step=not rendered)

    def record(self, messages: list[RankMessage]) -> None:
        self.turns.append([_row(m) for m in messages])
        self.done = any(st["job_id"] == "next" and st["outcome"] == "succeeded"
                        for st in self.turns[-1])

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _scripted_replica(rank: int, world: int) -> list[list[dict[str, Any]]] | None:
    layout = Layout(dp=1, sp=2)
    platform = get_platform("cpu")
    pipe = load_pipeline(TINY_MODEL, device=platform.device,
                         sequence=open_sequence(layout, platform.backend))
    written: list[str] = []

    def write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        written.append(job_id)
        return f"{job_id}.mp4", f"{job_id}.png"

    loop = RankLoop(rank, pipe, write, platform, layout=layout)
    driver = ScriptedDriver() if rank == 0 else None
    run_loop(rank, world, loop, driver)
    if driver is None:
        assert not written, "only the leader stores the replica's videos"
        return None
    return driver.turns


def test_a_replica_reports_each_step_once_and_a_cancel_ends_its_job_on_both_ranks() -> None:
    turns = run_ranks(2, _scripted_replica, timeout=180)[0]
    jobs = [st for turn in turns for st in turn if st["job_id"] is not None]
    # Only the leader speaks for the replica's job: progress, the cancel, the end.
    assert {st["rank"] for st in jobs} == {0}, jobs
    for turn in turns:
        assert len([st for st in turn if st["job_id"] is not None
                    and st["outcome"] is None]) <= 1, turn
    # Progress goes up by one each step: every step reported once, none twice.
    long_steps = [st["step"] for st in jobs if st["job_id"] == "long" and st["outcome"] is None]
    assert long_steps == list(range(1, len(long_steps) + 1)), long_steps
    assert CANCEL_AFTER <= len(long_steps) <= CANCEL_AFTER + 1
    next_steps = [st["step"] for st in jobs if st["job_id"] == "next" and st["outcome"] is None]
    assert next_steps == [1, 2], next_steps
    assert [(st["job_id"], st["outcome"]) for st in jobs if st["outcome"] is not None] == [
        ("long", "cancelled"), ("next", "rendered"), ("next", "succeeded")]
    # Each turn both ranks hold the same job (their own report, "held"): the cancel ended LONG
    # on both, and both took NEXT in the same turn.
    for turn in turns:
        held = {st["rank"]: st["held"] for st in turn if st["held"] != "-"}
        assert held.keys() == {0, 1} and held[0] == held[1], turn
    sequence = [turn_held for turn in turns
                if (turn_held := next(st["held"] for st in turn if st["held"] != "-"))]
    assert sequence[0] == "long" and "next" in sequence
    assert sequence.index("next") == len([s for s in sequence if s == "long"])


# ---- the service at dp=2 x sp=2 --------------------------------------------------------------

@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    # Long jobs, to be cancelled: they never run out while the test looks at them.
    with running_service(db, redis_client, redis_prefix, tmp_path, users=["alice"],
                         dp=2, sp=2, max_num_inference_steps=2000) as svc:
        yield svc


def _replicas(client: Any) -> list[dict[str, Any]]:
    [group] = client.get("/v1/workers").json()["data"]
    assert (group["dp_size"], group["sp_size"], group["world_size"]) == (2, 2, 4), group
    return list(group["replicas"])


def _until_replicas_show(client: Any, jobs: dict[int, str | None],
                         timeout: float = 30) -> list[dict[str, Any]]:
    """Polls ``/v1/workers`` until replica i shows ``jobs[i]`` (the group reports every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = _replicas(client)
        if {r["replica"]: r["job_id"] for r in replicas} == jobs:
            return replicas
        assert time.monotonic() < deadline, (replicas, jobs)
        time.sleep(0.1)


def test_a_cancel_ends_one_replicas_job_and_that_replica_takes_the_next(
        service: Service, tmp_path: Path) -> None:
    with api_client(service) as client:
        first = client.post("/v1/jobs", json={**JOB, "prompt": "first",
                                              "num_inference_steps": 2000})
        first_id = first.json()["id"]
        seen = []
        while not seen or seen[-1]["step"] < 3:
            seen.append(wait_job(client, first_id, lambda j: j["status"] == "running"))
        # Progress as the API shows it: one count for the replica, never past the job's steps.
        steps = [j["step"] for j in seen]
        assert steps == sorted(steps) and {j["total_steps"] for j in seen} == {2000}, steps
        second = client.post("/v1/jobs", json={**JOB, "prompt": "second",
                                               "num_inference_steps": 2000})
        second_id = second.json()["id"]
        wait_job(client, second_id, lambda j: j["status"] == "running")
        rank_of = {job_id: job_row(service, job_id).rank for job_id in (first_id, second_id)}
        assert sorted(rank_of.values()) == [0, 2], rank_of  # each on its replica's leader
        replica_of = {job_id: rank // 2 for job_id, rank in rank_of.items()}
        replicas = _until_replicas_show(client, {replica_of[first_id]: first_id,
                                                 replica_of[second_id]: second_id})
        assert [r["ranks"] for r in replicas] == [[0, 1], [2, 3]]

        assert client.post(f"/v1/jobs/{first_id}/cancel").status_code in (200, 202)
        asked_at = client.get(f"/v1/jobs/{first_id}").json()["step"]
        cancelled = wait_job(client, first_id, lambda j: j["status"] == "cancelled", timeout=30)
        assert cancelled["step"] <= asked_at + 2
        # The other replica carries on.
        still = client.get(f"/v1/jobs/{second_id}").json()
        assert still["status"] == "running", still

        # The freed replica takes the next job (another shape: a rank of it still on the
        # cancelled job would break its collectives) and renders what one rank does.
        body = {**JOB, "prompt": "next", "num_frames": 5, "num_inference_steps": 3, "seed": 5}
        nxt = client.post("/v1/jobs", json=body).json()["id"]
        done = wait_job(client, nxt, lambda j: j["status"] not in ("queued", "running"))
        assert done["status"] == "succeeded", done
        assert job_row(service, nxt).rank == rank_of[first_id]
        assert client.get(f"/v1/jobs/{second_id}").json()["status"] == "running"
        _until_replicas_show(client, {replica_of[first_id]: None,
                                      replica_of[second_id]: second_id})
        assert client.post(f"/v1/jobs/{second_id}/cancel").status_code in (200, 202)
        wait_job(client, second_id, lambda j: j["status"] == "cancelled", timeout=30)

        served = tmp_path / "next.mp4"
        served.write_bytes(client.get(f"/v1/jobs/{nxt}/video").content)
    pipe = load_pipeline(TINY_MODEL)
    try:
        request = VideoRequest(prompt="next", width=64, height=64, num_frames=5,
                               num_inference_steps=3, seed=5)
        frames = frames_to_uint8(pipe.generate(request)).numpy()
    finally:
        pipe.close()
    local, _ = write_outputs(frames, tmp_path / "local.mp4", fps=8)
    assert np.array_equal(_decoded(served), _decoded(Path(local)))


def _decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
