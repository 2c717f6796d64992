"""Chaos soak: thousands of tiny jobs through the whole service while its servers and processes
are killed, then the accounting that says whether a job was lost, ended twice, or was charged an
attempt for a fault it did not cause.

What runs, all on this machine: a private ``redis-server`` without persistence (a restart comes
back empty), a fresh PostgreSQL database behind a TCP proxy (the database can refuse connections
while the server stays up), ``kiln api``, ``kiln celery`` (the lease reaper and the queue-index
reconcile on short intervals) and a ``kiln worker --dp 2`` group on the CPU, started again
whenever it exits, as a supervisor would. Every service process reaches the database through the
proxy; the soak reads it directly. ``--users`` users submit tiny kiln-tiny jobs through the API at
``--rate`` jobs/s (a 503 or a dropped connection is retried with the same ``Idempotency-Key``)
while a seeded schedule injects ``--faults`` faults at random times, one after another, each once
the service is whole again:

- ``redis``: the Redis server killed, started again empty ~10 s later;
- ``database``: the proxy refuses connections for 10-30 s;
- ``rank``: kill -9 of a rank while it renders (its pid from ``/v1/workers``);
- ``launcher``: kill -9 of the worker launcher; a new ``kiln worker`` is started;
- ``sigterm``: SIGTERM to the worker's process group (a graceful drain), then a new one;
- ``celery``: the Celery processes killed, started again.

``--poison`` jobs in the stream are poisonous: the soak kills whichever rank renders one, every
time, so each must end ``dead`` after its attempts while the others render.

Once every job has ended (or ``--settle-timeout`` passed), the job events give the figures:
retries (attempts beyond the first), lost jobs (never terminal), duplicated ones (two terminal
events, or two successful renders), wrongly charged attempts (a charged end whose attempt was
claimed on a rank the soak did not kill), dead jobs, and the longest time the queue stood still
after a fault ended (from its end, or from the next submission if nothing was queued then, to the
first finish of a job claimed after it). Exit status 1 if a job was lost, duplicated or wrongly
charged, a job other than the poisonous ones did not succeed, a submission was given up, or a
process of the service outlived its stop.

Usage: python bench/chaos.py [--jobs 2000] [--users 20] [--rate 4] [--faults 24] [--poison 3]
       [--steps 4] [--seed 1] [--keep]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import make_url, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fault servers the fault tests use

from faults import PrivateRedis, TcpProxy  # noqa: E402

from bench.service_latency import KILN, fresh_database  # noqa: E402
from common.procs import free_port, stop_group  # noqa: E402
from storage.db import make_engine, make_session_factory  # noqa: E402
from storage.tables import Job, JobEvent, JobState  # noqa: E402
from storage.users import create_api_key  # noqa: E402

KINDS = ("redis", "database", "rank", "launcher", "sigterm", "celery")
TERMINAL = {"succeeded", "failed", "cancelled", "dead", "expired"}
ENDS = TERMINAL | {"requeued"}  # the events that end an attempt
JOB = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9, "fps": 8}
# Long enough (a few seconds on a CPU rank) that the soak sees it running and kills its rank.
POISON_STEPS = 100
DRAIN_SECONDS = 10
# The service's settings for the soak: the reaper and the reconcile every few seconds; a lease
# above the longest database outage plus a renewal interval, so an outage alone lapses none.
SETTINGS = {"KILN_LEASE_SECONDS": "60", "KILN_REAPER_INTERVAL_SECONDS": "2",
            "KILN_RECONCILE_INTERVAL_SECONDS": "3", "KILN_MAX_ATTEMPTS": "3",
            "KILN_ENVIRONMENT": "local", "PYTHONUNBUFFERED": "1"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- the servers and processes the faults are done to ------------------------------------------

class Child:
    """One ``kiln`` command in a process group of its own, its output appended to a log file.
    While a fault is done to it the fault holds ``lock``; otherwise `supervise` starts it again
    when it exits, as ``kiln up`` does."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.started: list[int] = []  # pids, which are also the process groups
        self.exits: list[str] = []  # exits nobody asked for

    def start(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(self.proc.pid)
        return self.proc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def supervise(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:
                self.exits.append(f"{self.name} {self.proc.pid} exited with "
                                  f"{self.proc.returncode}")
                log(f"{self.exits[-1]}; starting it again")
                self.start()

    def stop(self, timeout: float = 30) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                stop_group(self.proc, timeout=timeout)
            self.proc = None


# ---- what the soak records ----------------------------------------------------------------------

@dataclass(slots=True)
class Fault:
    kind: str
    start: float  # wall clock (time.time()), as the job events are
    end: float = 0.0  # when the server came back, or the process was killed / started again
    detail: str = ""


@dataclass(slots=True)
class Record:
    """Everything the soak did, for the accounting."""

    began: float = field(default_factory=time.time)
    submitted: set[str] = field(default_factory=set)  # the ids the API answered with
    unsubmitted: list[str] = field(default_factory=list)  # jobs given up on, and why
    # Answers that made a submit try again: status or error -> how many.
    submit_retries: collections.Counter[str] = field(default_factory=collections.Counter)
    poison: set[str] = field(default_factory=set)
    faults: list[Fault] = field(default_factory=list)
    # (group id, rank) -> why the soak killed it with -9: "fault" or "poison".
    killed: dict[tuple[str, int], str] = field(default_factory=dict)
    poison_kills: list[float] = field(default_factory=list)  # when each was done
    sigterm_exits: list[int | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


# ---- the service under test ---------------------------------------------------------------------

class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path, db_url: str) -> None:
        self.args = args
        self.rng_load = random.Random(args.seed)  # who submits what, and when
        self.rng = random.Random(args.seed + 1)  # the faults: their order, times and lengths
        self.engine = make_engine(db_url, pool_size=4, max_overflow=4)
        self.sessions = make_session_factory(self.engine)
        self.rec = Record()
        self.stop = threading.Event()
        if shutil.which("redis-server") is None:
            raise SystemExit("the chaos soak needs redis-server on PATH")
        self.redis = PrivateRedis(tmp / "redis")
        url = make_url(db_url)
        self.proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
        proxied = url.set(host="127.0.0.1", port=self.proxy.port)
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        logs = tmp / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        env = {**os.environ, **SETTINGS,
               "KILN_DATABASE_URL": proxied.render_as_string(hide_password=False),
               "REDIS_URL": self.redis.url, "KILN_OUTPUT_DIR": str(tmp / "outputs"),
               "KILN_DATA_DIR": str(tmp / "data"), "KILN_MODELS": '["kiln-tiny"]'}
        self.api = Child("api", [KILN, "api", "--port", str(self.api_port)], env, logs)
        self.celery = Child("celery", [KILN, "celery", "--concurrency", "1", "--loglevel",
                                       "WARNING"], env, logs)
        self.worker = Child("worker", [KILN, "worker", "--dp", "2", "--drain-seconds",
                                       str(DRAIN_SECONDS)], env, logs)
        self.db_refusing = False
        self.groups: list[dict[str, Any]] = []  # the latest /v1/workers answer
        with self.sessions() as s:
            self.admin_key = create_api_key(s, "chaos-admin", is_admin=True).key
            self.keys = {f"user{u:02d}": create_api_key(s, f"user{u:02d}").key
                         for u in range(args.users)}
        self.http = httpx.Client(base_url=self.api_url, timeout=10,
                                 headers={"Authorization": f"Bearer {self.admin_key}"})

    # Start, supervise, stop.
    def start(self) -> None:
        self.redis.start()
        self.proxy.accept()
        self.api.start()
        deadline = time.monotonic() + 60
        while not self._api_ready():
            if time.monotonic() > deadline or not self.api.alive():
                raise RuntimeError(f"the API did not start; see {self.api.log_path}")
            time.sleep(0.2)
        self.celery.start()
        self.worker.start()
        for loop in (self._supervise, self._watch_groups, self._kill_poison):
            threading.Thread(target=loop, daemon=True).start()
        if not self.wait_whole(timeout=180):
            raise RuntimeError(f"the worker group did not start; see {self.worker.log_path}")

    def _api_ready(self) -> bool:
        try:
            return self.http.get("/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _supervise(self) -> None:
        while not self.stop.wait(0.2):
            self.worker.supervise()
            self.celery.supervise()

    def _watch_groups(self) -> None:
        while not self.stop.wait(0.3):
            self._refresh_groups()

    def _refresh_groups(self) -> list[dict[str, Any]]:
        try:
            r = self.http.get("/v1/workers")
        except httpx.HTTPError:
            return self.groups
        if r.status_code == 200:
            self.groups = r.json()["data"]
        return self.groups

    def current_group(self) -> dict[str, Any] | None:
        """The ready group of the launcher running now, once every rank has reported its pid."""
        proc = self.worker.proc
        if proc is None or proc.poll() is not None:
            return None
        for g in self.groups:
            pids = [r.get("pid") for r in g["ranks"]]
            if (g["state"] == "ready" and not g["stale"] and f"-{proc.pid}-" in g["id"]
                    and len(pids) == g["world_size"] and all(pids)):
                return g
        return None

    def wait_whole(self, timeout: float) -> bool:
        """Until every server answers and a new worker group is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.proxy.accepting and self.redis.proc is not None and self.celery.alive()
                    and self.current_group() is not None):
                return True
            time.sleep(0.2)
        return False

    def shutdown(self) -> None:
        self.stop.set()
        self.worker.stop(timeout=DRAIN_SECONDS + 30)
        self.celery.stop()
        self.api.stop()
        self.http.close()
        if self.redis.proc is not None:
            self.redis.kill()
        if self.proxy.accepting:
            self.proxy.refuse()
        self.engine.dispose()

    def leftovers(self) -> list[str]:
        """Processes of the soak's children still running after they were stopped (a rank
        whose launcher was killed, say); they are killed."""
        time.sleep(1)
        groups = {pid for child in (self.api, self.celery, self.worker) for pid in child.started}
        left = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) in groups and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} ({' '.join(p.info['cmdline'] or [])[:80]})")
                    p.kill()
        return left

    # The load.
    def submit_all(self) -> None:
        """Every user's jobs at random times over ``jobs / rate`` seconds; the poisonous ones
        among them. Returns when every job was answered (or given up on)."""
        args = self.args
        window = args.jobs / args.rate
        users = list(self.keys)
        plan: dict[str, list[tuple[float, int]]] = {u: [] for u in users}
        poison = set(self.rng_load.sample(range(args.jobs), args.poison))
        for i in range(args.jobs):
            plan[users[i % len(users)]].append((self.rng_load.uniform(0, window), i))
        threads = [threading.Thread(target=self._submitter, args=(u, sorted(p), poison))
                   for u, p in plan.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _submitter(self, user: str, plan: list[tuple[float, int]], poison: set[int]) -> None:
        headers = {"Authorization": f"Bearer {self.keys[user]}"}
        with httpx.Client(base_url=self.api_url, timeout=30, headers=headers) as client:
            for at, i in plan:
                delay = self.rec.began + at - time.time()
                if delay > 0:
                    time.sleep(delay)
                steps = POISON_STEPS if i in poison else self.args.steps
                body = {**JOB, "prompt": f"chaos {user} job {i}", "seed": i,
                        "num_inference_steps": steps}
                job_id = self._submit(client, body, f"chaos-{i}")
                if job_id is not None and i in poison:
                    self.rec.poison.add(job_id)

    def _submit(self, client: httpx.Client, body: dict[str, Any], key: str) -> str | None:
        """POST until answered; an outage (503, a dropped connection) is retried with the same
        ``Idempotency-Key``, for up to five minutes."""
        deadline = time.monotonic() + 300
        while True:
            wait = 1.0
            try:
                r = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            except httpx.TransportError as exc:
                answer = type(exc).__name__
            else:
                if r.status_code in (200, 201):
                    with self.rec.lock:
                        self.rec.submitted.add(r.json()["id"])
                    return str(r.json()["id"])
                answer = str(r.status_code)
                if r.status_code not in (429, 503):  # not an outage: retrying will not help
                    self.rec.unsubmitted.append(f"{key}: {r.status_code} {r.text[:200]}")
                    return None
                wait = float(r.headers.get("Retry-After", wait))
            with self.rec.lock:
                self.rec.submit_retries[answer] += 1
            if time.monotonic() + wait > deadline:
                self.rec.unsubmitted.append(f"{key}: still {answer} after 300 s")
                return None
            time.sleep(min(wait, 2.0))

    # The poisonous jobs: whichever rank renders one dies, every time.
    def _kill_poison(self) -> None:
        killed: set[str] = set()  # attempt tokens
        while not self.stop.wait(0.05):
            # Not while the database refuses: the launcher could not end the group's attempts
            # then (kiln.worker.recover_attempts), so the reaper would, charging every one.
            if not self.rec.poison or self.db_refusing:
                continue
            # Killed once it renders (a step done), as a crash the job causes would come: not in
            # the moment of the claim, while the rank may still be storing its last job's files.
            with self.sessions() as s:
                rows = s.execute(select(Job.id, Job.attempt_token, Job.worker_group_id, Job.rank)
                                 .where(Job.id.in_(list(self.rec.poison)),
                                        Job.state == JobState.RUNNING,
                                        Job.progress_step >= 1)).all()
            for job_id, token, group_id, rank in rows:
                if token in killed or rank is None:
                    continue
                pid = self._pid_of(group_id, rank)
                if pid is None:
                    continue
                if self._kill_rank(group_id, rank, pid, "poison"):
                    killed.add(token)
                    self.rec.poison_kills.append(time.time())
                    log(f"poison job {job_id}: killed rank {rank} (pid {pid}) of {group_id}")

    def _pid_of(self, group_id: str, rank: int) -> int | None:
        for refresh in (False, True):
            groups = self._refresh_groups() if refresh else self.groups
            for g in groups:
                if g["id"] == group_id:
                    for r in g["ranks"]:
                        if r["rank"] == rank and r.get("pid"):
                            return int(r["pid"])
        return None

    def _kill_rank(self, group_id: str, rank: int, pid: int, why: str) -> bool:
        with self.rec.lock:
            self.rec.killed[(group_id, rank)] = why
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False

    # The faults.
    def inject_all(self, until: Callable[[], bool]) -> None:
        """``--faults`` faults of every kind in turn, in a seeded order, at seeded times over
        the submission window; each waits for the service to be whole again and for no poisonous
        job to be running (its kill and the fault would blur who is to blame)."""
        args = self.args
        count = args.faults
        kinds = [KINDS[i % len(KINDS)] for i in range(count)]
        self.rng.shuffle(kinds)
        window = args.jobs / args.rate
        times = sorted(self.rng.uniform(0.03 * window, 0.97 * window) for _ in range(count))
        for kind, at in zip(kinds, times, strict=True):
            delay = self.rec.began + at - time.time()
            if delay > 0:
                time.sleep(delay)
            since = self.rec.faults[-1].end if self.rec.faults else 0.0
            if not self.wait_settled(since, timeout=240):
                log("the service did not settle after the last fault; injecting anyway")
            fault = Fault(kind, time.time())
            getattr(self, f"_fault_{kind}")(fault)
            fault.end = fault.end or time.time()
            self.rec.faults.append(fault)
            log(f"fault {len(self.rec.faults)}/{count}: {kind} {fault.detail} "
                f"({fault.end - fault.start:.1f} s)")
        until()

    def wait_settled(self, since: float, timeout: float) -> bool:
        """Until, for a second on end, the service is whole, no poisonous job runs, and the
        queue has moved since ``since`` (a job started after it succeeded) or is empty."""
        deadline = time.monotonic() + timeout
        calm_since = None
        while time.monotonic() < deadline:
            if self.wait_whole(timeout=deadline - time.monotonic()) and self._calm(since):
                calm_since = calm_since or time.monotonic()
                if time.monotonic() - calm_since >= 1.0:
                    return True
            else:
                calm_since = None
            time.sleep(0.2)
        return False

    def _calm(self, since: float) -> bool:
        after = datetime.fromtimestamp(since, UTC)
        with self.sessions() as s:
            poisoned = s.scalar(select(Job.id).where(Job.id.in_(list(self.rec.poison)),
                                                     Job.state == JobState.RUNNING).limit(1))
            moved = s.scalar(select(Job.id).where(Job.started_at >= after,
                                                  Job.state == JobState.SUCCEEDED).limit(1))
            waiting = s.scalar(select(Job.id).where(Job.state == JobState.QUEUED).limit(1))
        return poisoned is None and (moved is not None or waiting is None)

    def _fault_redis(self, fault: Fault) -> None:
        seconds = self.rng.uniform(8, 12)
        self.redis.kill()
        time.sleep(seconds)
        self.redis.start()
        fault.end = time.time()
        fault.detail = f"down {seconds:.0f} s, back empty"

    def _fault_database(self, fault: Fault) -> None:
        seconds = self.rng.uniform(10, 30)
        self.db_refusing = True
        self.proxy.refuse()
        time.sleep(seconds)
        self.proxy.accept()
        self.db_refusing = False
        fault.end = time.time()
        fault.detail = f"refusing {seconds:.0f} s"

    def _fault_rank(self, fault: Fault) -> None:
        group = self.current_group()
        deadline = time.monotonic() + 10
        while group is not None:
            with self.sessions() as s:
                busy = [rank for job_id, rank in s.execute(
                    select(Job.id, Job.rank).where(Job.worker_group_id == group["id"],
                                                   Job.state == JobState.RUNNING))
                        if job_id not in self.rec.poison and rank is not None]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if group is None:
            fault.detail = "no group to kill a rank of"
            return
        rank = self.rng.choice(busy) if busy else self.rng.randrange(group["world_size"])
        pid = next(int(r["pid"]) for r in group["ranks"] if r["rank"] == rank)
        fault.start = time.time()
        self._kill_rank(group["id"], rank, pid, "fault")
        fault.detail = f"rank {rank} (pid {pid}, {'busy' if busy else 'idle'})"

    def _fault_launcher(self, fault: Fault) -> None:
        with self.worker.lock:
            proc = self.worker.proc
            assert proc is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(1.0)  # a supervisor notices, then starts a new one
            self.worker.start()
        fault.detail = f"pid {proc.pid}; its ranks drain on their own"

    def _fault_sigterm(self, fault: Fault) -> None:
        with self.worker.lock:
            proc = self.worker.proc
            assert proc is not None
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=DRAIN_SECONDS + 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = None
                proc.wait()
            self.rec.sigterm_exits.append(code)
            took = time.time() - fault.start
            self.worker.start()
        fault.detail = f"drained and exited {code} in {took:.1f} s"

    def _fault_celery(self, fault: Fault) -> None:
        with self.celery.lock:
            proc = self.celery.proc
            assert proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(2.0)  # a supervisor notices, then starts it again
            self.celery.start()
        fault.detail = "killed, started again"

    # The end.
    def wait_until_all_end(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.sessions() as s:
                left = s.scalar(select(Job.id).where(
                    Job.state.in_([JobState.QUEUED, JobState.RUNNING])).limit(1))
            if left is None:
                return
            time.sleep(1)
        log(f"not every job ended within {timeout:.0f} s")

    def rows(self) -> tuple[list[Job], list[JobEvent]]:
        with self.sessions() as s:
            jobs = list(s.scalars(select(Job)))
            events = list(s.scalars(select(JobEvent).order_by(JobEvent.id)))
            s.expunge_all()
        return jobs, events


# ---- the accounting -----------------------------------------------------------------------------

def account(rec: Record, jobs: list[Job], events: list[JobEvent]) -> dict[str, Any]:
    """The soak's figures from the rows and what the soak did."""
    by_job: dict[str, list[JobEvent]] = collections.defaultdict(list)
    for e in events:
        by_job[e.job_id].append(e)
    rows = {j.id: j for j in jobs}
    lost = sorted(j for j in rec.submitted if j not in rows
                  or rows[j].state not in TERMINAL)
    unasked = sorted(j for j in rows if j not in rec.submitted)  # rows nobody was answered for
    duplicated, wrongly_charged, mismatched = [], [], []
    charges: list[dict[str, Any]] = []  # every charged end of an attempt
    retries: collections.Counter[str] = collections.Counter()
    finishes: list[tuple[float, float]] = []  # (claimed at, finished at) of each final attempt
    for job_id, job_events in by_job.items():
        claims = {e.attempt: e for e in job_events if e.kind == "claimed"}
        ends = [e for e in job_events if e.kind in ENDS]
        per_attempt = collections.Counter(e.attempt for e in ends)
        if (sum(e.kind in TERMINAL for e in ends) > 1
                or sum(e.kind == "succeeded" for e in ends) > 1
                or any(n > 1 for n in per_attempt.values())):
            duplicated.append(job_id)
        charged = 0
        for e in ends:
            if e.kind == "requeued":
                retries[e.detail.get("code", "lease_expired")] += 1
            # The reaper's ends carry no "charged": a lapsed lease is always charged.
            if e.kind in ("requeued", "dead", "failed") and e.detail.get("charged", True):
                charged += 1
                claim = claims.get(e.attempt)
                where = (None if claim is None else
                         (claim.detail.get("worker_group_id"), claim.detail.get("rank")))
                cause = e.detail.get("code") or e.detail.get("reason")
                charges.append({"job": job_id, "attempt": e.attempt, "end": e.kind,
                                "cause": cause, "claimed_on": where, "ended_at": e.at,
                                "claimed_at": None if claim is None else claim.at,
                                "poison": job_id in rec.poison, "killed": rec.killed.get(where)})
                if where not in rec.killed:
                    wrongly_charged.append((job_id, e.attempt, e.kind, cause))
        job = rows[job_id]
        if job.attempts - job.uncharged_attempts != charged + (job.state == "succeeded"):
            mismatched.append(job_id)
        last = ends[-1] if ends else None
        if last is not None and last.kind in TERMINAL and last.attempt in claims:
            finishes.append((claims[last.attempt].at.timestamp(), last.at.timestamp()))
    states = collections.Counter(j.state for j in jobs)
    dead = sorted(j.id for j in jobs if j.state == "dead")
    not_succeeded = sorted(j.id for j in jobs if j.id not in rec.poison
                           and j.state != "succeeded")
    poison_not_dead = sorted(j for j in rec.poison if rows.get(j) is None
                             or rows[j].state != "dead")
    submitted_at = sorted(j.created_at.timestamp() for j in jobs)
    finished_at = sorted(f for _, f in finishes)
    last_finish = finished_at[-1] if finished_at else time.time()
    return {
        "jobs_submitted": len(rec.submitted), "unsubmitted": rec.unsubmitted,
        "submit_retries": rec.submit_retries, "states": dict(states),
        "faults": collections.Counter(f.kind for f in rec.faults),
        "poison_kills": len(rec.poison_kills),
        "retries": sum(max(0, j.attempts - 1) for j in jobs), "retries_by_cause": retries,
        "lost": lost, "duplicated": duplicated + unasked, "wrongly_charged": wrongly_charged,
        "charges": charges,
        "attempt_counts_mismatched": mismatched,
        "dead": dead, "poison": sorted(rec.poison), "poison_not_dead": poison_not_dead,
        "not_succeeded": not_succeeded,
        "recoveries": recoveries(rec.faults, finishes, submitted_at),
        "longest_stall": longest_stall(finished_at, submitted_at, rec.faults),
        "processing_seconds": last_finish - (submitted_at[0] if submitted_at else last_finish),
        "finished": len(finished_at),
    }


def _queued_at(t: float, submitted_at: list[float], finished_at: list[float]) -> bool:
    """Whether some job was submitted by ``t`` and not finished yet."""
    return bisect.bisect_right(submitted_at, t) > bisect.bisect_right(finished_at, t)


def recoveries(faults: list[Fault], finishes: list[tuple[float, float]],
               submitted_at: list[float]) -> list[tuple[Fault, float | None]]:
    """Per fault, how long the queue stood still after it: from its end (or, if nothing was
    queued then, from the next submission) to the first finish of a job claimed after its end;
    None if none ever finished."""
    finished_at = sorted(f for _, f in finishes)
    out = []
    for fault in faults:
        start = fault.end
        if not _queued_at(start, submitted_at, finished_at):
            later = bisect.bisect_right(submitted_at, start)
            if later == len(submitted_at):
                continue  # nothing was submitted after it
            start = submitted_at[later]
        after = [f for c, f in finishes if c >= fault.end and f >= start]
        out.append((fault, min(after) - start if after else None))
    return out


def longest_stall(finished_at: list[float], submitted_at: list[float],
                  faults: list[Fault]) -> tuple[float, float, str]:
    """The longest gap between two finishes while work was queued: (seconds, its start, the
    fault it began in or after)."""
    best = (0.0, 0.0, "")
    for a, b in zip(finished_at, finished_at[1:], strict=False):
        if b - a > best[0] and _queued_at(a, submitted_at, finished_at):
            before = [f for f in faults if f.start <= b]
            best = (b - a, a, before[-1].kind if before else "")
    return best


def report(figures: dict[str, Any], soak: Soak, wall: float, leftovers: list[str]) -> list[str]:
    """Prints the figures; returns what failed."""
    f = figures
    recs = f["recoveries"]
    worst = max(recs, key=lambda r: float("inf") if r[1] is None else r[1], default=None)
    per_kind: dict[str, float] = {}
    for fault, took in recs:
        per_kind[fault.kind] = max(per_kind.get(fault.kind, 0.0),
                                   float("inf") if took is None else took)
    stall, stall_at, stall_kind = f["longest_stall"]
    lines = [
        f"jobs submitted        {f['jobs_submitted']} of {soak.args.jobs} (submits tried again "
        f"after: {dict(f['submit_retries']) or 'none'}; {len(f['unsubmitted'])} given up)",
        f"final states          {dict(sorted(f['states'].items()))}",
        f"faults                {sum(f['faults'].values())}: " + ", ".join(
            f"{k} {f['faults'][k]}" for k in KINDS if f["faults"][k]),
        f"poison kills          {f['poison_kills']} (ranks killed rendering the "
        f"{len(f['poison'])} poisonous jobs)",
        f"launchers started     {len(soak.worker.started)} (SIGTERM exits "
        f"{soak.rec.sigterm_exits}); exits nobody asked for, started again: "
        f"{'; '.join(soak.worker.exits + soak.celery.exits) or 'none'}",
        f"retries               {f['retries']} attempts beyond the first: " + ", ".join(
            f"{k} {n}" for k, n in f["retries_by_cause"].most_common()),
        f"charged attempts      {len(f['charges'])}: "
        f"{sum(c['poison'] for c in f['charges'])} of the poisonous jobs, " + ", ".join(
            f"{sum(c['killed'] == why and not c['poison'] for c in f['charges'])} of other jobs "
            f"on the {sum(w == why for w in soak.rec.killed.values())} ranks killed {what}"
            for why, what in (("fault", "by a rank fault"), ("poison", "for a poisonous job"))),
        f"lost                  {len(f['lost'])}",
        f"duplicated            {len(f['duplicated'])}",
        f"wrongly charged       {len(f['wrongly_charged'])}",
        f"dead                  {len(f['dead'])} (poisonous: "
        f"{len(set(f['dead']) & set(f['poison']))} of {len(f['poison'])})",
        "queue still after a fault: longest " + (
            "n/a" if worst is None else
            f"{'never moved' if worst[1] is None else f'{worst[1]:.1f} s'} after "
            f"{worst[0].kind} ({worst[0].detail})") + "; per kind: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in sorted(per_kind.items())),
        f"longest stall         {stall:.1f} s with work queued (in or after a {stall_kind} "
        f"fault)",
        f"wall time             {wall:.0f} s ({f['processing_seconds']:.0f} s from the first "
        f"submit to the last finish)",
        f"throughput            {f['finished'] / max(f['processing_seconds'], 1e-9):.2f} "
        f"jobs/s over the run",
    ]
    moved = {id(fault): took for fault, took in recs}
    for fault in soak.rec.faults:
        took = moved.get(id(fault), "")
        # A poisonous job's rank killed meanwhile restarts the group too: its time is in here.
        until = fault.end + (took if isinstance(took, float) else 0.0)
        poisoned = any(fault.start - 1 <= t <= until for t in soak.rec.poison_kills)
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(fault.start))} "
                     f"{fault.kind:<9}{fault.detail:<44} " + (
                         "nothing submitted after it" if took == "" else
                         "the queue never moved again" if took is None else
                         f"the queue moved {took:.1f} s after its end")
                     + (" (a poisonous job's rank was killed meanwhile)" if poisoned else ""))
    print("\n".join(lines), flush=True)
    failures = []
    for name in ("lost", "duplicated", "wrongly_charged", "not_succeeded", "poison_not_dead",
                 "unsubmitted", "attempt_counts_mismatched"):
        if f[name]:
            failures.append(f"{name}: {f[name][:10]}")
    if leftovers:
        failures.append(f"processes left running after the stop: {leftovers}")
    for failure in failures:
        print(f"FAILED {failure}", flush=True)
    return failures


def summary(figures: dict[str, Any], soak: Soak, wall: float) -> dict[str, Any]:
    """The soak's figures as counts and seconds, for ``--json`` (the benchmark report)."""
    f = figures
    per_kind: dict[str, float | None] = {}
    for fault, took in f["recoveries"]:  # None: the queue never moved again
        prev = per_kind.get(fault.kind, 0.0)
        per_kind[fault.kind] = None if took is None or prev is None else max(prev, took)
    stall, _, stall_kind = f["longest_stall"]
    return {
        "jobs": soak.args.jobs, "jobs_submitted": f["jobs_submitted"],
        "submit_retries": sum(dict(f["submit_retries"]).values()),
        "unsubmitted": len(f["unsubmitted"]), "states": dict(sorted(f["states"].items())),
        "faults": {k: f["faults"][k] for k in KINDS if f["faults"][k]},
        "poison_kills": f["poison_kills"], "retries": f["retries"],
        "lost": len(f["lost"]), "duplicated": len(f["duplicated"]),
        "wrongly_charged": len(f["wrongly_charged"]), "dead": len(f["dead"]),
        "poisonous": len(f["poison"]),
        "queue_still_after_fault_s": per_kind,
        "longest_stall_s": stall, "longest_stall_after": stall_kind,
        "wall_seconds": wall, "processing_seconds": f["processing_seconds"],
        "jobs_per_s": f["finished"] / max(f["processing_seconds"], 1e-9),
        "seed": soak.args.seed,
    }


# ---- the run ------------------------------------------------------------------------------------

@contextlib.contextmanager
def workdir(args: argparse.Namespace) -> Iterator[Path]:
    """A temporary directory for the logs, outputs and Redis; kept with ``--keep`` or when the
    soak failed (``args.keep`` is read on the way out)."""
    path = Path(tempfile.mkdtemp(prefix="kiln-chaos-"))
    try:
        yield path
    finally:
        if args.keep:
            log(f"logs and outputs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--rate", type=float, default=4.0, help="jobs submitted per second")
    p.add_argument("--faults", type=int, default=24,
                   help="faults to inject, every kind in turn (0: the same load without faults)")
    p.add_argument("--poison", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="denoising steps of each job")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle-timeout", type=float, default=600,
                   help="once every job is submitted, how long they have to end")
    p.add_argument("--keep", action="store_true", help="keep the logs and outputs")
    p.add_argument("--json", help="also write the figures, as counts and seconds, to this file")
    args = p.parse_args()
    began = time.time()
    with workdir(args) as tmp, fresh_database("postgresql", tmp) as db_url:
        soak = Soak(args, tmp, db_url)
        try:
            log(f"starting: Redis on {soak.redis.port}, the database through {soak.proxy.port}, "
                f"the API on {soak.api_port}; logs in {soak.logs}")
            soak.start()
            soak.rec.began = time.time()
            log(f"submitting {args.jobs} jobs from {args.users} users over "
                f"{args.jobs / args.rate:.0f} s, with {args.faults} faults")
            submitter = threading.Thread(target=soak.submit_all)
            submitter.start()
            soak.inject_all(until=submitter.join)
            log(f"every job submitted; waiting for the last ones (at most "
                f"{args.settle_timeout:.0f} s)")
            soak.wait_whole(timeout=120)
            soak.wait_until_all_end(args.settle_timeout)
            jobs, events = soak.rows()
        finally:
            soak.shutdown()
        leftovers = soak.leftovers()
        figures = account(soak.rec, jobs, events)
        failures = report(figures, soak, time.time() - began, leftovers)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {**summary(figures, soak, time.time() - began), "failures": failures},
                indent=1, default=str))
        if failures or args.keep:
            args.keep = True  # the logs say why
            (tmp / "figures.json").write_text(json.dumps(
                {**figures, "faults": [asdict(f) for f in soak.rec.faults],
                 "killed": sorted(soak.rec.killed.items())}, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
