"""``kiln worker --layout auto``: the planner chooses the group's layout for its goal, and the
group reports the choice and the runner-up in /v1/workers.

The profile is written by hand into the data directory (as `kiln plan` would cache it), shaped so
that splitting a job pays for one job's latency while replicas give more jobs per hour; the
planner's own measuring is tested in tests/runtime/test_planner.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from servers import api_client, serving_api, wait_job, worker_group

from common.families import TINY_MODEL
from common.settings import Settings
from kiln.worker import WorkerConfig, plan_layout
from runtime.planner import Profile, checkpoint_fingerprint, machine_description, profile_path

JOB = {"model": TINY_MODEL, "width": 64, "height": 64, "num_frames": 9, "fps": 8,
       "num_inference_steps": 4}


def _write_profile(data_dir: Path) -> None:
    profile = Profile(
        model=TINY_MODEL, machine=machine_description(),
        checkpoint=checkpoint_fingerprint(TINY_MODEL), created_at=time.time(), cores=8,
        num_blocks=4, max_block_bytes=10**6, block_bytes=4 * 10**6, nonblock_bytes=10**5,
        width_tokens=(48, 192), block_seconds=(0.0001, 0.001), gather_seconds_per_byte=1e-10,
        gather_latency_seconds=1e-5,
        all_to_all_seconds_per_byte=1e-10, all_to_all_latency_seconds=1e-5,
        activation_bytes_per_token=1024, prepare_seconds=0.001, decode_seconds=0.001,
        decode_pixels=64 * 64 * 9, framework_bytes=200 * 10**6,
        per_rank_bytes={"allgather": 10**7, "rank-local": 10**7},
        crowded_collective_seconds=0.0)
    path = profile_path(data_dir, TINY_MODEL)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())


@pytest.mark.parametrize(("goal", "dp", "sp"), [("latency", 1, 2), ("throughput", 2, 1)])
def test_the_planner_chooses_the_layout_for_the_goal(tmp_path: Path, goal: str, dp: int,
                                                     sp: int) -> None:
    _write_profile(tmp_path)
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    config = plan_layout(settings, WorkerConfig(goal=goal, auto_world=2))
    assert (config.dp, config.sp, config.auto_world) == (dp, sp, None)
    plan: dict[str, Any] = config.plan or {}
    assert plan["goal"] == goal and plan["world"] == 2 and plan["job"] == "64x64x9x4"
    assert (plan["chosen"]["dp"], plan["chosen"]["sp"]) == (dp, sp)
    assert plan["runner_up"]["layout"] != plan["chosen"]["layout"]
    assert plan["profile"].startswith("cached profile") and plan["reason"]


def test_layout_auto_is_refused_where_it_cannot_plan(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="on cuda give --dp and --sp"):
        plan_layout(settings, WorkerConfig(device="cuda", auto_world=2))


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_group_started_with_layout_auto_serves_and_reports_its_plan(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _write_profile(data_dir)
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=["alice"]) as service, \
            worker_group(service, dp=1, goal="latency", data_dir=str(data_dir),
                         args=["--layout", "auto", "--world", "2"]):
        with api_client(service) as client:
            (group,) = client.get("/v1/workers").json()["data"]
            assert (group["dp_size"], group["sp_size"], group["world_size"]) == (1, 2, 2)
            plan = group["plan"]
            assert plan["chosen"]["layout"].startswith("dp=1 x sp=2")
            assert plan["runner_up"]["layout"] and plan["goal"] == "latency"
            r = client.post("/v1/jobs", json={**JOB, "prompt": "a red circle", "seed": 1})
            assert r.status_code == 201, r.text
            done = wait_job(client, r.json()["id"],
                            lambda j: j["status"] not in ("queued", "running"))
            assert done["status"] == "succeeded", done
