"""Resume is exact: one rank of a worker group killed with SIGKILL in the middle of a job costs
at most the steps since the job's last checkpoint, and the job's video is the one an
uninterrupted render of the same request and seed gives, bit for bit; a drain (SIGTERM)
recomputes nothing.

Real servers: the API over HTTP, the real Redis, a real ``kiln worker`` process group. A 30-step
job, checkpointed every 5 steps, is watched in the database until it has done 20 steps; then ONE
rank process of the replica that renders it is killed (not the launcher, not the whole group).
The launcher sees the rank die, ends the group's attempts (the dead rank's job charged,
`kiln.worker.recover_attempts`) and starts a new rank set on its own; that set claims the job
again and resumes it from the newest checkpoint the killed one stored.

Layouts: dp=2 (allgather and rank-local) and sp=2; models: kiln-tiny and a tiny random-weight
Wan directory. With dp=2 the lone job runs on the first replica, so the rank killed is rank 0
(the coordinator's too); with sp=2 it is rank 1, whose leader survives it. One more case keeps
both replicas of a dp=2 group busy and kills rank 1: the surviving rank's step fails on its lost
peer, and its job must resume from its own checkpoint as well. Every case is slow (a group
start, a kill and a restart, and a reference render): they run with ``KILN_CHAOS=1`` (``make
chaos``), as does the drain case; ``make test`` keeps the resume through a rank of its own
(tests/runtime/test_rank_loop_resume.py) and the killed-rank restarts (test_worker_restarts.py).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from servers import api_client, decoded, job_row, serving_api, wait_job, worker_group

from runtime.launch import rank_threads
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, generate_on_ranks, load_pipeline
from storage import queries
from storage.outputs import checkpoint_key
from storage.video import write_outputs

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

# Only with KILN_CHAOS=1, as `make chaos` runs them (tests/conftest.py).
SLOW = pytest.mark.chaos

STEPS = 30
KILL_AT = 20  # the step the job has reached when the rank is killed
EVERY = 5  # checkpoint every this many steps (and never by time: the schedule is exact)

# Job sizes chosen so that a step takes ~0.3 s on a CPU rank (one torch thread): slow enough
# that the 20 ms poll below sees step 20 and kills the rank well before step 21 ends (and the
# checkpoint of step 20, handed to its thread at the step boundary, is stored by then), short
# enough that a 30-step job renders in ~10 s. kiln-tiny at 384x384, 9 frames: ~0.29 s a step
# (256x256, 17 frames would be ~0.17 s). The tiny Wan (4 blocks of width 128, below) at 256x256,
# 17 frames: ~0.26 s a step, its VAE decode ~2 s (at 384x384 the decode alone takes 5 s).
JOBS: dict[str, dict[str, Any]] = {
    "kiln-tiny": {"prompt": "a red circle moving left", "width": 384, "height": 384,
                  "num_frames": 9, "num_inference_steps": STEPS, "fps": 8, "seed": 7},
    "wan": {"prompt": "a red circle moving left", "width": 256, "height": 256,
            "num_frames": 17, "num_inference_steps": STEPS, "fps": 8, "seed": 7},
}
# The tiny Wan: 4 blocks of width 128 (4 heads of 32, which sp=2 divides), random weights.
WAN = {"family": "wan", "num_layers": 4, "width": 128}

# name -> (dp, sp, allgather)
LAYOUTS = {"dp2-allgather": (2, 1, True), "dp2-rank-local": (2, 1, False), "sp2": (1, 2, True)}
CASES = [pytest.param(model, layout, id=f"{model}-{layout}", marks=SLOW)
         for model in JOBS for layout in LAYOUTS]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Here, not at the top: diffusers and transformers load only for the Wan cases.
    from runtime.models.synthetic import SyntheticSpec, make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("models") / "wan", SyntheticSpec(**WAN)))


def _model(request: pytest.FixtureRequest, name: str) -> str:
    return "kiln-tiny" if name == "kiln-tiny" else str(request.getfixturevalue("wan_dir"))


def _served(client: Any, job_id: str, path: Path) -> np.ndarray:
    r = client.get(f"/v1/jobs/{job_id}/video")
    assert r.status_code == 200, r.text
    path.write_bytes(r.content)
    return decoded(path)


def _uninterrupted(model: str, body: dict[str, Any], dp: int, sp: int, allgather: bool,
                   out: Path) -> np.ndarray:
    """The same request rendered without a stop, with the torch threads a rank of the group has,
    written as the group writes it: here for a replica of one rank (each replica of a dp group
    renders what one process does), on ranks of the same split for sp > 1."""
    request = VideoRequest(**{k: v for k, v in body.items() if k != "model"})
    if sp > 1:
        frames = torch.from_numpy(generate_on_ranks(model, [request], dp=1, sp=sp,
                                                    use_allgather=allgather)[0])
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(rank_threads(dp * sp))
        pipe = load_pipeline(model, use_allgather=allgather)
        try:
            frames = pipe.generate(request)
        finally:
            pipe.close()
            torch.set_num_threads(threads)
    local, _ = write_outputs(frames_to_uint8(frames).numpy(), out, fps=body["fps"])
    return decoded(Path(local))


def _ranks(service: Any, client: Any, group_id: str) -> dict[int, int]:
    """rank -> pid of ``group_id``'s rank processes, as the group reports them."""
    groups = {g["id"]: g for g in client.get("/v1/workers").json()["data"]}
    assert group_id in groups, (group_id, list(groups))
    return {r["rank"]: r["pid"] for r in groups[group_id]["ranks"]}


def _rank_process(launcher: Any, pid: int) -> psutil.Process:
    """The launcher's child process ``pid``: a spawned rank, not the launcher itself nor its
    multiprocessing helpers."""
    children = {p.pid: p for p in psutil.Process(launcher.pid).children(recursive=True)}
    assert pid in children and pid != launcher.pid, (pid, sorted(children))
    proc = children[pid]
    assert "spawn_main" in " ".join(proc.cmdline()), proc.cmdline()
    return proc


def _checkpoint_step(service: Any, job_id: str) -> int:
    """The step a job's stored checkpoint holds (its safetensors header's metadata)."""
    with service.store.open(checkpoint_key(job_id)) as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return int(header["__metadata__"]["step_index"])


def _ended(job: dict[str, Any]) -> bool:
    return job["status"] not in ("queued", "running")


@pytest.mark.parametrize(("model_name", "layout"), CASES)
def test_a_job_whose_rank_is_killed_at_step_20_resumes_exactly_from_its_checkpoint(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path,
        request: pytest.FixtureRequest, model_name: str, layout: str) -> None:
    started = time.monotonic()
    model = _model(request, model_name)
    dp, sp, allgather = LAYOUTS[layout]
    body = {"model": model, **JOBS[model_name]}
    args = ["--model", model, *([] if allgather else ["--no-allgather"])]
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     models=[model]) as service, api_client(service) as client, \
            worker_group(service, dp=dp, sp=sp, args=args, checkpoint_every_steps=EVERY,
                         checkpoint_every_seconds=0) as launcher:
        ready = time.monotonic()
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]

        # 1. Watch the job's row until it has done KILL_AT steps.
        deadline = time.monotonic() + 120
        while True:
            row = job_row(service, job_id)
            if row.state == "running" and row.progress_step >= KILL_AT:
                break
            assert row.state in ("queued", "running"), row.state
            assert time.monotonic() < deadline, (row.state, row.progress_step)
            time.sleep(0.02)
        seen = row.progress_step
        assert seen < STEPS, "the job ended before a rank could be killed"
        killed_group = row.worker_group_id

        # 2. Kill ONE rank of the replica that renders it: with sp=2 the replica's last rank
        # (neither its leader nor rank 0's coordinator), with dp=2 the job's own rank.
        target = row.rank + sp - 1
        pid = _ranks(service, client, killed_group)[target]
        proc = _rank_process(launcher, pid)
        proc.kill()
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        assert launcher.poll() is None, "the launcher died with its rank"

        # 3. The launcher starts the ranks again by itself; the job comes back and finishes.
        done = wait_job(client, job_id, until=_ended, timeout=180)
        assert done["status"] == "succeeded", done
        assert launcher.poll() is None, "the launcher gave up"
        recovery = time.monotonic() - killed_at
        finished = job_row(service, job_id)
        assert finished.worker_group_id not in (None, killed_group)
        with service.db.session() as s:
            events = queries.job_events(s, job_id)
        kinds = [e.kind for e in events]
        assert kinds == ["created", "claimed", "requeued", "claimed", "resumed", "succeeded"], \
            kinds
        requeued = events[kinds.index("requeued")]
        # The dead rank's job is charged: it may have caused the crash.
        assert requeued.detail["code"] == "rank_crashed" and requeued.detail["charged"], \
            requeued.detail
        assert done["attempts"] == 2 and done["preemptions"] == 0, done

        # 4. It resumed from the newest checkpoint: at most EVERY steps computed twice.
        resumed = done["resumed_from_step"]
        assert resumed is not None and resumed % EVERY == 0, done
        recomputed = seen - resumed
        assert 0 <= recomputed <= EVERY, (seen, resumed)
        assert not service.store.exists(checkpoint_key(job_id)), "the checkpoint outlived it"
        served = _served(client, job_id, tmp_path / "served.mp4")
    stopped = time.monotonic()

    # 5. Its frames are those of an uninterrupted render, bit for bit.
    local = _uninterrupted(model, body, dp, sp, allgather, tmp_path / "local.mp4")
    assert served.shape == (body["num_frames"], body["height"], body["width"], 3)
    assert np.array_equal(served, local), int(np.abs(served.astype(int) - local).max())
    print(f"\n{model_name} {layout}: killed rank {target} (pid {pid}) at step {seen}; "
          f"resumed from step {resumed}: {recomputed} step(s) computed twice. Seconds: group "
          f"start {ready - started:.0f}, to the kill {killed_at - ready:.0f}, to success "
          f"{recovery:.0f}, reference {time.monotonic() - stopped:.0f}; case "
          f"{time.monotonic() - started:.0f}")


MODES = pytest.mark.parametrize("allgather", [True, False], ids=["allgather", "rank-local"])


@pytest.mark.chaos
@MODES
def test_both_replicas_jobs_resume_exactly_when_one_rank_of_a_busy_dp2_group_is_killed(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, allgather: bool) -> None:
    """dp=2, a job on each replica; rank 1 is killed at step 20 of its job. In allgather mode
    rank 0 survives, but its step fails (its weight gathers lost their peer) before the group
    goes down; rank-local, its replica goes on at its own pace until the launcher stops the
    group. Either way its job must keep its checkpoint too, and resume from it uncharged."""
    started = time.monotonic()
    bodies = [{"model": "kiln-tiny", **JOBS["kiln-tiny"], "seed": seed} for seed in (7, 8)]
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client, \
            worker_group(service, dp=2, args=[] if allgather else ["--no-allgather"],
                         checkpoint_every_steps=EVERY, checkpoint_every_seconds=0) as launcher:
        ids = [client.post("/v1/jobs", json=body).json()["id"] for body in bodies]
        deadline = time.monotonic() + 120
        while True:
            rows = [job_row(service, job_id) for job_id in ids]
            on_rank_1 = [r for r in rows if r.state == "running" and r.rank == 1]
            if on_rank_1 and on_rank_1[0].progress_step >= KILL_AT:
                break
            assert all(r.state in ("queued", "running") for r in rows), [r.state for r in rows]
            assert time.monotonic() < deadline, [(r.state, r.rank, r.progress_step) for r in rows]
            time.sleep(0.02)
        assert all(r.state == "running" and r.progress_step < STEPS for r in rows), \
            [(r.state, r.progress_step) for r in rows]
        seen = {r.id: r.progress_step for r in rows}
        victim = on_rank_1[0].id
        proc = _rank_process(launcher, _ranks(service, client, rows[0].worker_group_id)[1])
        proc.kill()
        proc.wait(timeout=10)
        done = {job_id: wait_job(client, job_id, until=_ended, timeout=180) for job_id in ids}
        assert launcher.poll() is None, "the launcher gave up"
        figures = []
        for job_id in ids:
            job = done[job_id]
            assert job["status"] == "succeeded", job
            with service.db.session() as s:
                requeued = next(e for e in queries.job_events(s, job_id) if e.kind == "requeued")
            # Only the dead rank's job is charged.
            expected = ("rank_crashed", True) if job_id == victim else ("group_failed", False)
            assert (requeued.detail["code"], requeued.detail["charged"]) == expected, \
                requeued.detail
            # (The survivor's row was read a moment before the victim's: it may have recorded
            # one more step before the kill, and checkpointed it; at its own pace, a few more
            # until the launcher stopped the group.)
            resumed = job["resumed_from_step"]
            slack = 0 if job_id == victim else 1 if allgather else STEPS
            assert resumed is not None and -slack <= seen[job_id] - resumed <= EVERY, (seen, job)
            figures.append((job_id == victim, seen[job_id], resumed))
        served = [_served(client, job_id, tmp_path / f"served-{i}.mp4")
                  for i, job_id in enumerate(ids)]
    for i, body in enumerate(bodies):
        local = _uninterrupted("kiln-tiny", body, 2, 1, allgather, tmp_path / f"local-{i}.mp4")
        assert np.array_equal(served[i], local), i
    lines = [f"{'killed rank 1' if killed else 'surviving rank 0'}'s job at step {step}, "
             f"resumed from {resumed} ({max(0, step - resumed)} computed twice)"
             for killed, step, resumed in figures]
    print(f"\n{'; '.join(lines)}; case {time.monotonic() - started:.0f} s")


@pytest.mark.chaos
@MODES
def test_a_job_drained_at_step_20_resumes_at_the_very_step_it_was_handed_back_at(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, allgather: bool) -> None:
    """SIGTERM with no drain time: the running job is handed back at once, its ranks
    checkpoint the step it had reached, and the next attempt starts there: 0 steps again."""
    started = time.monotonic()
    body = {"model": "kiln-tiny", **JOBS["kiln-tiny"]}
    env = {"checkpoint_every_steps": EVERY, "checkpoint_every_seconds": 0}
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client:
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        mode = [] if allgather else ["--no-allgather"]
        with worker_group(service, dp=2, args=["--drain-seconds", "0", *mode], **env) as group:
            seen = wait_job(client, job_id, timeout=120,
                            until=lambda j: j["status"] == "running" and j["step"] >= KILL_AT)
            os.killpg(group.pid, signal.SIGTERM)
            # Every step the attempt records before it goes back to the queue.
            reached = seen["step"]
            while (row := job_row(service, job_id)).state == "running":
                reached = max(reached, row.progress_step)
                time.sleep(0.01)
            assert group.wait(timeout=60) == 0
        assert row.state == "queued" and row.attempts == 1, (row.state, row.attempts)
        handed_back = _checkpoint_step(service, job_id)
        assert KILL_AT <= reached <= handed_back < STEPS, (reached, handed_back)
        with worker_group(service, dp=2, args=mode, **env):
            done = wait_job(client, job_id, timeout=120, until=_ended)
        assert done["status"] == "succeeded", done
        # Nothing recomputed: the next attempt starts at the step the drained one stopped at.
        assert done["resumed_from_step"] == handed_back, (done, handed_back)
        assert done["attempts"] == 2, done
        with service.db.session() as s:
            events = queries.job_events(s, job_id)
        requeued = next(e for e in events if e.kind == "requeued")
        assert requeued.detail["code"] == "worker_stopped" and not requeued.detail["charged"]
        served = _served(client, job_id, tmp_path / "served.mp4")
    local = _uninterrupted("kiln-tiny", body, 2, 1, allgather, tmp_path / "local.mp4")
    assert np.array_equal(served, local)
    print(f"\ndrained at step {seen['step']} (last recorded {reached}); checkpoint and resume "
          f"at step {handed_back}: 0 steps computed twice; case "
          f"{time.monotonic() - started:.0f} s")
