"""A failed output write retries the store, never the render: with real worker processes and
the real API, an output directory that refuses files for ~10 s, or a real file system that is
full (ENOSPC) for as long, pauses the group (degraded, with the store's reason) while it keeps
the finished jobs and their leases, and every job is stored and succeeds once, rendered once; a
group stopped while the store still fails hands its kept jobs back uncharged, and nothing
half-written is ever left under a final name."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Service, serving_api, worker_group
from sqlalchemy import select

from kiln.tasks import Context, reap_leases
from storage import queries
from storage.outputs import thumbnail_key, video_key
from storage.tables import Job
from storage.video import read_video

# A group fault scenario: `make test` runs it on PostgreSQL, `make chaos` on SQLite as well
# (tests/conftest.py).
pytestmark = pytest.mark.fault

JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}
FAULT = 10  # seconds the output directory refuses files
RECOVERY = 30  # seconds: the queue must move again within this of the store coming back
LEASE = 5  # seconds (the setting's minimum): the fault outlasts two leases


def _client(service: Service) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=30,
                        headers={"Authorization": f"Bearer {service.keys['alice']}"})


def _submit(client: httpx.Client, n: int, steps: int, tag: str) -> list[str]:
    ids = []
    for i in range(n):
        r = client.post("/v1/jobs", json={**JOB, "prompt": f"{tag} {i}", "seed": i,
                                           "num_inference_steps": steps})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def _rows(service: Service, ids: list[str]) -> dict[str, Job]:
    with service.db.session() as s:
        rows = {r.id: r for r in s.scalars(select(Job).where(Job.id.in_(ids)))}
        s.expunge_all()
    return rows


def _states(service: Service, ids: list[str]) -> dict[str, str]:
    return {job_id: row.state for job_id, row in _rows(service, ids).items()}


def _until(what: Callable[[], Any], timeout: float, group: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if group is not None:
            assert group.poll() is None, f"the worker group exited with {group.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


def _group(client: httpx.Client) -> dict[str, Any]:
    [group] = client.get("/v1/workers").json()["data"]
    return dict(group)


def _refuse_files(outputs: Path) -> Callable[[], None]:
    """Makes the output directory refuse new files until the returned function is called. For
    a user, its directories become read-only; for root (whom modes do not stop), its parent
    directory moves aside and a regular file takes its place, so every write under it fails
    with ENOTDIR."""
    if os.geteuid() != 0:
        dirs = [outputs, *(p for p in outputs.rglob("*") if p.is_dir())]
        for d in dirs:
            d.chmod(0o500)

        def restore_modes() -> None:
            for d in dirs:
                d.chmod(0o755)

        return restore_modes
    parent = outputs.parent
    aside = parent.with_name(parent.name + ".aside")
    parent.rename(aside)
    parent.write_bytes(b"not a directory")

    def restore_parent() -> None:
        parent.unlink()
        aside.rename(parent)

    return restore_parent


def _no_partial_files(outputs: Path) -> None:
    """Only whole files under final names: no temporaries of a failed write left behind."""
    leftovers = [p for p in outputs.rglob("*") if p.is_file() and p.name.startswith(".")]
    assert leftovers == []


def _fill_disk(outputs: Path) -> Callable[[], None]:
    """Fills the (small) file system the output directory is on with one file, so every write
    there fails with ENOSPC, until the returned function deletes it."""
    filler = outputs.parent / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush on close
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    assert os.statvfs(outputs).f_bavail == 0
    return filler.unlink


@contextlib.contextmanager
def _small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (needs root, as in CI): a real disk to fill.
    Skipped where mounting is not permitted, but under CI (``CI`` set) that fails instead."""
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                  str(where)], capture_output=True, text=True)
        why = mounted.stderr.strip() or f"mount exited with {mounted.returncode}"
    except FileNotFoundError:
        mounted, why = None, "no mount command"
    if mounted is None or mounted.returncode != 0:
        message = f"cannot mount a tmpfs to fill for a full-disk test: {why}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)


def _store_out_for_10_s(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path,
                        outputs: Path, fault: Callable[[Path], Callable[[], None]], why: str,
                        **overrides: Any) -> None:
    """Ten jobs on a dp=2 group; once two are stored, ``fault(outputs)`` makes the store fail
    for FAULT seconds (until the function it returns is called): the group holds what it
    rendered, claims nothing and says so (its reason names ``why``), and afterwards every job is
    stored and succeeds, rendered once. ``overrides``: more settings, for the API and the
    group."""
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     output_dir=outputs, lease_seconds=LEASE, **overrides) as service, \
            worker_group(service, dp=2, lease_seconds=LEASE, **overrides) as group, \
            _client(service) as client:
        reaper = Context(settings=service.settings, sessions=db.session,  # type: ignore[arg-type]
                         redis=redis_client, store=service.store)
        ids = _submit(client, 10, 40, "fault")
        _until(lambda: list(_states(service, ids).values()).count("succeeded") >= 2, 60, group)

        restore = fault(outputs)
        try:
            refused = time.monotonic()
            degraded = _until(lambda: (g := _group(client))["state"] == "degraded" and g, 15,
                              group)
            assert degraded["reason"].startswith("the output store is failing (rank ")
            assert "could not store" in degraded["reason"] and why in degraded["reason"]
            # From here on the group claims nothing; the finished jobs wait, their leases kept.
            started = {j for j, s in _states(service, ids).items() if s != "queued"}
            while time.monotonic() - refused < FAULT:
                states = _states(service, ids)
                assert {j for j, s in states.items() if s != "queued"} == started
                assert set(states.values()) <= {"queued", "running", "succeeded"}, states
                assert _group(client)["state"] == "degraded"
                # The group keeps the leases of the jobs it holds: the reaper finds none lapsed.
                assert reap_leases(reaper).requeued == []
                time.sleep(0.5)
            held = {j for j, s in _states(service, ids).items() if s == "running"}
            assert held, "some finished jobs were waiting for the store"
        finally:
            restore()
        back = time.monotonic()
        waiting = [j for j, s in _states(service, ids).items() if s == "queued"]
        assert waiting, "jobs were still queued when the store came back"
        # The queue moves again by itself.
        _until(lambda: any(s != "queued" for s in _states(service, waiting).values()),
               RECOVERY, group)
        assert time.monotonic() - back < RECOVERY
        _until(lambda: all(s == "succeeded" for s in _states(service, ids).values()), 90, group)
        _until(lambda: _group(client)["state"] == "ready", 10, group)
        assert _group(client)["reason"] is None

        rows = _rows(service, ids)
        assert all(r.attempts == 1 and r.uncharged_attempts == 0 for r in rows.values()), [
            (r.id, r.attempts, r.uncharged_attempts) for r in rows.values()]
        with service.db.session() as s:
            kinds = {job_id: [e.kind for e in queries.job_events(s, job_id)] for job_id in ids}
        assert all(k == ["created", "claimed", "succeeded"] for k in kinds.values()), kinds
        # The jobs that waited for the store are whole videos, served as such.
        for job_id in held:
            r = client.get(f"/v1/jobs/{job_id}/video")
            assert r.status_code == 200
            served = tmp_path / f"{job_id}.mp4"
            served.write_bytes(r.content)
            assert read_video(served).shape == (9, 64, 64, 3)
        _no_partial_files(outputs)


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_an_output_directory_refusing_files_for_10_s_pauses_the_group_and_nothing_renders_twice(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    _store_out_for_10_s(db, redis_client, redis_prefix, tmp_path, tmp_path / "outs" / "outputs",
                        _refuse_files, "could not store")


@pytest.mark.chaos  # slow (a 10 s outage): `make chaos` runs it, `make test` does not
def test_a_full_output_disk_for_10_s_pauses_the_group_and_nothing_renders_twice(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    # ENOSPC from a real file system, filled. No previews: a job that ends deletes its preview,
    # and the pages that frees would let a small file through while the disk is meant full.
    with _small_disk(tmp_path / "disk", "16m") as disk:
        _store_out_for_10_s(db, redis_client, redis_prefix, tmp_path, disk / "outputs",
                            _fill_disk, "No space left on device", preview_every_steps=0)


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_group_stopped_while_the_store_fails_hands_its_finished_job_back_uncharged(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    outputs = tmp_path / "outs" / "outputs"
    outputs.mkdir(parents=True)
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",),
                     output_dir=outputs) as service, _client(service) as client:
        restore = _refuse_files(outputs)
        try:
            with worker_group(service, dp=2, args=["--drain-seconds", "2"]) as group:
                [job_id] = _submit(client, 1, 10, "stopped")
                degraded = _until(lambda: (g := _group(client))["state"] == "degraded" and g,
                                  60, group)
                assert "could not store" in degraded["reason"]
                assert _states(service, [job_id]) == {job_id: "running"}
                asked = time.monotonic()
                os.killpg(group.pid, signal.SIGTERM)
                assert group.wait(timeout=30) == 0
                assert time.monotonic() - asked < 2 + 10
        finally:
            restore()
        job = _rows(service, [job_id])[job_id]
        assert job.state == "queued", (job.state, job.error)
        assert (job.attempts, job.uncharged_attempts) == (1, 1)
        assert job.error_code == "worker_stopped"
        store = service.store
        assert not store.exists(video_key(job_id)) and not store.exists(thumbnail_key(job_id))
        _no_partial_files(outputs)

        # Once the store takes files, a group renders it: the stop was not charged.
        with worker_group(service, dp=2) as group:
            done = _until(lambda: (r := _rows(service, [job_id])[job_id]).state == "succeeded"
                          and r, 60, group)
        assert (done.attempts, done.uncharged_attempts) == (2, 1)
        assert store.exists(video_key(job_id))
