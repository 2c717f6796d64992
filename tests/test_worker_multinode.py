"""One worker group over two nodes: README's ``torchrun --nnodes 2`` command, run here as two
launchers on one machine (each in a process group of its own, one rank each, meeting at a c10d
rendezvous on a free port), against the real API, Redis and PostgreSQL.

The group serves jobs end to end: four kiln-tiny jobs submitted over HTTP render on both ranks,
and each served video equals a local render of the same request; ``/v1/workers`` shows one group
of two ranks, one process per node. SIGTERM to both launchers stops the group gracefully within a
bound, and no rank is left running.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import av
import httpx
import numpy as np
import psutil
import pytest
from servers import KILN, Service, serving_api, worker_env
from sqlalchemy import select

from common.procs import free_port
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline
from storage.tables import Job, WorkerGroup
from storage.video import write_outputs

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4, "fps": 8}
READY_S = 90.0  # both launchers meet, load the model and report ready
JOBS_S = 60.0  # the four jobs render
STOP_S = 30.0  # after SIGTERM, both launchers are gone


class Node:
    """One ``torchrun --nnodes 2 --nproc-per-node 1`` launcher, its output in ``log``."""

    def __init__(self, name: str, endpoint: str, rdzv_id: str, env: dict[str, str],
                 log: Path) -> None:
        self.name = name
        self.log = log
        self.out: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
             KILN, "worker", "--device", "cpu", "--model", "kiln-tiny"],
            env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks: list[psutil.Process] = []  # the launcher's children, as last seen

    def children(self) -> list[psutil.Process]:
        """Every process this launcher started (its ranks run in sessions of their own, out of
        its process group), remembered for the cleanup."""
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        known = {p.pid for p in self.ranks}
        self.ranks += [p for p in found if p.pid not in known]
        return found

    def tail(self, lines: int = 40) -> str:
        self.out.flush()
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + "\n".join(text)

    def kill(self) -> None:
        """Whatever is left of this node: the launcher's group and every rank it started."""
        self.children()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        for p in self.ranks:
            try:
                if p.is_running():
                    p.kill()
                    p.wait(timeout=10)
            except psutil.NoSuchProcess:
                pass
        self.out.close()


def _env(service: Service) -> dict[str, str]:
    env = worker_env(service)
    # A launcher of its own on each node: nothing of an outer launch leaks in.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"  # each node one of this machine's cores
    return env


def _until(what: str, check: Callable[[], Any], deadline_s: float, nodes: list[Node],
           running: bool = True) -> Any:
    """Polls ``check()`` until it returns something truthy, within ``deadline_s``; while
    ``running``, a launcher that exits fails it at once. Failures show both nodes' output."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = check()
        if found:
            return found
        gone = [n.name for n in nodes if running and n.proc.poll() is not None]
        if gone or time.monotonic() > deadline:
            why = f"{', '.join(gone)} exited" if gone else f"not within {deadline_s:.0f} s"
            pytest.fail(f"{what}: {why}\n" + "\n".join(n.tail() for n in nodes))
        time.sleep(0.2)


def _decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as svc:
        yield svc


@pytest.fixture
def nodes(service: Service, tmp_path: Path) -> Iterator[list[Node]]:
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"kiln-{secrets.token_hex(4)}"
    env = _env(service)
    started: list[Node] = []
    try:
        for name in ("node-a", "node-b"):
            started.append(Node(name, endpoint, rdzv_id, env, tmp_path / f"{name}.log"))
        yield started
    finally:
        for node in started:
            node.kill()


# Nodes on two machines share a database server: PostgreSQL only.
@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_group_of_two_torchrun_nodes_serves_jobs_and_stops_on_sigterm(
        service: Service, nodes: list[Node], tmp_path: Path) -> None:
    started = time.monotonic()
    client = httpx.Client(base_url=service.url, timeout=30,
                          headers={"Authorization": f"Bearer {service.keys['alice']}"})

    def ready() -> dict[str, Any] | None:
        for group in client.get("/v1/workers").json()["data"]:
            if group["state"] == "ready" and len(group["ranks"]) == 2:
                return dict(group)
        return None

    with client:
        group = _until("the group reported ready", ready, READY_S, nodes)
        assert (group["world_size"], group["dp_size"], group["sp_size"]) == (2, 2, 1), group
        assert [r["rank"] for r in group["ranks"]] == [0, 1], group
        # One rank on each node: the ranks are the launchers' own children.
        ranks = {n.name: [p.pid for p in n.children()] for n in nodes}
        assert all(len(pids) == 1 for pids in ranks.values()), ranks
        assert {r["pid"] for r in group["ranks"]} == {pids[0] for pids in ranks.values()}, \
            (group, ranks)

        specs = [{**JOB, "prompt": f"shape number {i}", "seed": 200 + i} for i in range(4)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            created = list(pool.map(lambda body: client.post("/v1/jobs", json=body), specs))
        assert all(r.status_code == 201 for r in created), [r.text for r in created]
        job_ids = [r.json()["id"] for r in created]

        def all_succeeded() -> bool:
            states = [client.get(f"/v1/jobs/{j}").json()["status"] for j in job_ids]
            assert not {"failed", "dead", "cancelled"} & set(states), states
            return all(s == "succeeded" for s in states)

        _until("the jobs succeeded", all_succeeded, JOBS_S, nodes)
        with service.db.session() as s:
            rendered_on = {s.scalar(select(Job.rank).where(Job.id == j)) for j in job_ids}
        assert rendered_on == {0, 1}, rendered_on  # both nodes rendered

        pipe = load_pipeline("kiln-tiny")
        try:
            for job_id, body in zip(job_ids, specs, strict=True):
                r = client.get(f"/v1/jobs/{job_id}/video")
                assert r.status_code == 200, r.text
                served = tmp_path / f"{job_id}.mp4"
                served.write_bytes(r.content)
                request = VideoRequest(prompt=body["prompt"], width=64, height=64, num_frames=9,
                                       num_inference_steps=4, seed=body["seed"])
                frames = frames_to_uint8(pipe.generate(request)).numpy()
                local, _ = write_outputs(frames, tmp_path / f"local-{job_id}.mp4", fps=8)
                decoded = _decoded(served)
                assert decoded.shape == (9, 64, 64, 3), decoded.shape
                assert np.array_equal(decoded, _decoded(Path(local))), job_id
        finally:
            pipe.close()

        # What systemd or docker sends each node; torchrun passes it on to its rank.
        asked = time.monotonic()
        for node in nodes:
            os.killpg(node.proc.pid, signal.SIGTERM)
        _until("both launchers exited after SIGTERM",
               lambda: all(n.proc.poll() is not None for n in nodes), STOP_S, nodes,
               running=False)
        took = time.monotonic() - asked

    leftover = [p for n in nodes for p in n.ranks if p.is_running()]
    assert not leftover, leftover
    with service.db.session() as s:
        row = s.get(WorkerGroup, group["id"])
        assert row is not None
        # Rank 0 reported the group stopped on its way out: a graceful stop, not a crash.
        assert row.state == "stopped", (row.state, row.state_reason,
                                        "\n".join(n.tail() for n in nodes))
    assert took < STOP_S, took
    print(f"two nodes: ready, 4 jobs and stop in {time.monotonic() - started:.1f} s "
          f"(stop {took:.1f} s)")


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_when_a_node_dies_the_other_hands_its_jobs_back_uncharged_at_once(
        service: Service, nodes: list[Node]) -> None:
    # Under torchrun no launcher of kiln's ends a failed group's attempts: rank 0 does on its
    # way out, rather than leaving them to be charged by the reaper when their leases lapse.
    client = httpx.Client(base_url=service.url, timeout=30,
                          headers={"Authorization": f"Bearer {service.keys['alice']}"})
    with client:
        _until("the group reported ready",
               lambda: any(g["state"] == "ready" for g in client.get("/v1/workers").json()["data"]),
               READY_S, nodes)
        long_job = {**JOB, "num_inference_steps": 200}
        job_ids = [client.post("/v1/jobs", json={**long_job, "prompt": f"p {i}", "seed": i})
                   .json()["id"] for i in range(2)]

        def both_running() -> bool:
            return all(client.get(f"/v1/jobs/{j}").json()["status"] == "running" for j in job_ids)

        _until("both jobs running", both_running, JOBS_S, nodes)
        killed = time.monotonic()
        nodes[1].kill()  # node B: its launcher and its rank, SIGKILL

        def both_queued() -> bool:
            return all(client.get(f"/v1/jobs/{j}").json()["status"] == "queued" for j in job_ids)

        _until("both jobs back in the queue", both_queued, 30, nodes[:1], running=False)
        took = time.monotonic() - killed
    with service.db.session() as s:
        rows = [s.get(Job, j) for j in job_ids]
        assert all(r is not None and r.uncharged_attempts == 1 for r in rows), [
            (r.attempts, r.uncharged_attempts, r.error) for r in rows if r]
    assert took < 30, took  # the lease is 120 s: this was not the reaper
