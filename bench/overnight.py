"""The overnight scenario: interactive jobs arriving at random while batch jobs fill a dp=2 group.

The whole service, as deployed: a fresh PostgreSQL database (migrated, dropped at the end), the
real Redis under a prefix of its own, ``kiln api`` on a free port and ``kiln worker --dp 2`` on
the CPU, in allgather (``--allgather``) and in rank-local (``--no-allgather``) mode, a fresh
service per mode. Jobs go through the HTTP API; their figures come from the database's own
timestamps, and the time of a job's first step from polling its progress. In each mode, in order:

1. warm-up: a batch-sized job of 2 steps on each replica, then 2 interactive jobs;
2. ``solo``: ``--solo`` interactive jobs at kiln-tiny's defaults (only model, prompt and class
   given), one at a time on the idle group;
3. ``batch alone``: two batch jobs of ``--batch`` (WxHxFRAMESxSTEPS), one per replica,
   submitted as one batch (``POST /v1/batches``), with nothing beside them;
4. ``mixed``: the same two batch jobs, and once both run, ``--interactive`` interactive jobs
   submitted at random times (seeded, uniform over the first 80 % of the batch-alone makespan).

Steps 2 to 4 run ``--rounds`` times in turn (solo, alone, mixed, solo, alone, mixed...): the
machine's speed drifts over minutes, so each round's mixed makespan is held against the alone
makespan just before it, and the median round is the one reported.

What is measured, per job (wall clock, the database's timestamps and this process's agree):

- wait: submit (POST sent) -> first step, the first poll (every ``--poll-ms``) that saw the
  job's progress at step 1 or beyond; a job that ended between two polls counts its
  ``finished_at``. Also shown: submit -> claim (``started_at``), the step boundary where the
  group took the job, which is just before its first step starts;
- latency: submit -> ``finished_at`` of a succeeded job; and, once the group has taken it,
  its ``render_seconds`` (claim -> ``finished_at``, the database's own timestamps). The wait
  is bounded on its own: a job is taken at a step boundary, so it waits for the batch step in
  progress, which is longer than a whole solo render of a small job whenever the batch job's
  steps are big;
- makespan of the batch jobs: the first batch job's ``started_at`` -> the last one's
  ``finished_at``; one batch step: a batch job's ``render_seconds`` / its steps, alone.

The acceptance bounds (issue 23), each printed with the figures it was computed from:

- p95 wait of the mixed interactive jobs <= one batch step + 1 s;
- p95 latency of the mixed interactive jobs <= 2x the solo latency (median of the solo jobs),
  submit -> end and claim -> end;
- batch makespan mixed <= 1.1 x (makespan alone + number of interactive jobs x their solo
  ``render_seconds``, median);
- every job ended exactly once: succeeded, one claim, one final event, nothing requeued, and
  every ``preempted`` event of a batch job followed by its ``continued``.

Also reported: whether the scenario was the one specified (each batch job >= 60 s alone, at
least 20 interactive jobs); ``--quick`` runs a small one (2 minutes or so per mode) that is not.
Exit status 1 if a bound does not hold in some mode.

Usage: python bench/overnight.py [--quick] [--modes allgather,rank_local] [--rounds 2]
       [--batch 256x256x33x150] [--interactive 20] [--solo 5] [--seed 1] [--poll-ms 50]
       [--json [PATH]] [--logs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.service_latency import (  # noqa: E402
    KILN,
    fresh_database,
    make_key,
    process,
    wait_healthy,
)
from common.procs import free_port  # noqa: E402

FULL = {"batch": "256x256x33x150", "interactive": 20, "solo": 5}
QUICK = {"batch": "256x256x33x24", "interactive": 6, "solo": 3}
MODE_FLAGS = {"allgather": "--allgather", "rank_local": "--no-allgather"}
SPEC_BATCH_SECONDS = 60.0  # the scenario asks for batch jobs of at least this long
SPEC_INTERACTIVE = 20
INTERACTIVE = {"model": "kiln-tiny", "prompt": "a blue square turning", "class": "interactive"}
TERMINAL = {"succeeded", "failed", "cancelled", "dead", "expired"}
ARRIVAL_SHARE = 0.8  # arrivals fall in this first share of the batch-alone makespan
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- the service: API and worker group for one mode --------------------------------------------

@dataclass
class Service:
    client: httpx.Client  # the API, with the bench user's key
    engine: Any  # the database, read for timestamps, progress and events
    logs: Path


def wait_group_ready(client: httpx.Client, worker: subprocess.Popen[bytes],
                     timeout: float = 300) -> None:
    """Until the worker group has loaded its model and reported ready."""
    deadline = time.monotonic() + timeout
    while not any(g["state"] == "ready" for g in client.get("/v1/workers").json()["data"]):
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the worker group never reported ready")
        time.sleep(0.2)


def show_logs(logs: Path, lines: int = 30) -> None:
    """The last lines of the service's logs, on stderr: the temporary directory goes away."""
    for path in sorted(logs.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)


@contextlib.contextmanager
def service(mode: str, tmp: Path) -> Iterator[Service]:
    """A fresh database and Redis prefix, ``kiln api`` and ``kiln worker --dp 2`` in ``mode``."""
    import redis

    from storage.db import make_engine

    logs = tmp / mode
    logs.mkdir(parents=True)
    prefix = f"kiln-overnight-{secrets.token_hex(3)}:"
    port = free_port()
    with fresh_database("postgresql", tmp) as db_url:
        engine = make_engine(db_url)
        env = {**os.environ, "KILN_DATABASE_URL": db_url, "REDIS_URL": REDIS_URL,
               "KILN_REDIS_PREFIX": prefix, "KILN_OUTPUT_DIR": str(logs / "outputs"),
               "KILN_DATA_DIR": str(logs / "data"), "KILN_ENVIRONMENT": "local",
               "PYTHONUNBUFFERED": "1"}
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Bearer {make_key(db_url)}"})
        try:
            with process([KILN, "api", "--port", str(port)], env, log=logs / "api.log"), \
                    process([KILN, "worker", "--dp", "2", MODE_FLAGS[mode]], env,
                            log=logs / "worker.log", stop_timeout=60) as worker:
                try:
                    wait_healthy(str(client.base_url))
                    wait_group_ready(client, worker)
                    yield Service(client, engine, logs)
                except Exception:
                    show_logs(logs)
                    raise
        finally:
            client.close()
            engine.dispose()
            r = redis.Redis.from_url(REDIS_URL)
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)
            r.close()


# ---- running jobs ------------------------------------------------------------------------------

@dataclass
class Track:
    """One job as the bench saw it; the times are epoch seconds."""

    id: str
    role: str  # warmup | solo | batch_alone | batch | interactive
    sent: float  # when its POST was sent
    first_step: float | None = None  # the poll that first saw step >= 1
    ended: bool = False


def batch_body(size: str, steps: int | None = None, *, name: str) -> dict[str, Any]:
    """``POST /v1/batches``: two jobs of ``size`` (WxHxFRAMESxSTEPS), one per replica."""
    w, h, f, s = (int(v) for v in size.lower().split("x"))
    defaults = {"model": "kiln-tiny", "width": w, "height": h, "num_frames": f,
                "num_inference_steps": steps or s}
    return {"name": name, "defaults": defaults,
            "jobs": [{"prompt": "a red circle moving left"}, {"prompt": "a green line falling"}]}


def submit_batch(client: httpx.Client, body: dict[str, Any], role: str) -> list[Track]:
    sent = time.time()
    r = client.post("/v1/batches", json=body)
    r.raise_for_status()
    jobs = client.get("/v1/jobs", params={"batch_id": r.json()["id"], "limit": 200})
    jobs.raise_for_status()
    return [Track(job["id"], role, sent) for job in jobs.json()["data"]]


def submit_interactive(client: httpx.Client, role: str) -> Track:
    sent = time.time()
    r = client.post("/v1/jobs", json=INTERACTIVE)
    r.raise_for_status()
    return Track(r.json()["id"], role, sent)


def poll(svc: Service, tracks: list[Track]) -> None:
    """One look at the unfinished jobs: notes the first step and the end of each."""
    from sqlalchemy import select

    from storage.tables import Job

    open_ = {t.id: t for t in tracks if not t.ended}
    if not open_:
        return
    with svc.engine.connect() as conn:
        rows = conn.execute(select(Job.id, Job.state, Job.progress_step)
                            .where(Job.id.in_(list(open_)))).all()
    now = time.time()
    for job_id, state, step in rows:
        t = open_[job_id]
        if state == "running" and step >= 1 and t.first_step is None:
            t.first_step = now
        t.ended = state in TERMINAL


def run_phase(svc: Service, *, batch: dict[str, Any] | None = None, batch_role: str = "",
              arrivals: Sequence[float] = (), role: str = "interactive", poll_s: float = 0.05,
              timeout: float = 3600) -> list[Track]:
    """Submits ``batch`` (if any); once all its jobs run, an interactive job at each of
    ``arrivals`` (seconds from then); polls until every job has ended."""
    tracks = submit_batch(svc.client, batch, batch_role) if batch else []
    pending = sorted(arrivals)
    start: float | None = None if batch else time.time()
    deadline = time.monotonic() + timeout
    while True:
        if start is None and all(t.first_step is not None or t.ended for t in tracks):
            start = time.time()  # both replicas busy with the batch
        while start is not None and pending and time.time() >= start + pending[0]:
            pending.pop(0)
            tracks.append(submit_interactive(svc.client, role))
        poll(svc, tracks)
        if not pending and all(t.ended for t in tracks):
            return tracks
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs still open after {timeout:.0f} s")
        time.sleep(poll_s)


def rows(svc: Service, tracks: list[Track]) -> list[dict[str, Any]]:
    """Each job's figures: the bench's times and the database's."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from storage.tables import Job

    with Session(svc.engine) as session:
        found = {j.id: j for j in session.scalars(select(Job).where(
            Job.id.in_([t.id for t in tracks])))}
    out = []
    for t in tracks:
        j = found[t.id]
        started = j.started_at.timestamp() if j.started_at else None
        finished = j.finished_at.timestamp() if j.finished_at else None
        first = t.first_step if t.first_step is not None else finished
        out.append({**asdict(t), "state": j.state, "class": j.class_,
                    "steps": j.num_inference_steps, "render_seconds": j.render_seconds,
                    "preemptions": j.preemptions, "started_at": started,
                    "finished_at": finished, "first_step_seen": t.first_step is not None,
                    "claim_s": None if started is None else started - t.sent,
                    "wait_s": None if first is None else first - t.sent,
                    "latency_s": None if finished is None else finished - t.sent})
    return out


# ---- accounting --------------------------------------------------------------------------------

def ended_once(svc: Service, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every job ended exactly once: succeeded, one attempt (one claim, nothing requeued), one
    final event, and each suspension of a batch job continued. The problems, per job."""
    from sqlalchemy import select

    from storage.tables import JobEvent

    ids = [j["id"] for j in jobs]
    with svc.engine.connect() as conn:
        events = conn.execute(select(JobEvent.job_id, JobEvent.kind, JobEvent.detail,
                                     JobEvent.at)
                              .where(JobEvent.job_id.in_(ids)).order_by(JobEvent.id)).all()
    kinds: dict[str, Counter[str]] = {i: Counter() for i in ids}
    preempted_by: dict[str, str] = {}  # interactive job -> the batch job it suspended
    suspended: Counter[str] = Counter()  # job -> seconds from its preempted to its continued
    for job_id, kind, detail, at in events:
        kinds[job_id][kind] += 1
        if kind == "preempted":
            preempted_by[str(detail.get("by_job"))] = job_id
            suspended[job_id] -= at.timestamp()
        elif kind == "continued":
            suspended[job_id] += at.timestamp()
    problems = {}
    for j in jobs:
        k = kinds[j["id"]]
        finals = sum(k[kind] for kind in TERMINAL)
        wrong = []
        if j["state"] != "succeeded":
            wrong.append(f"state {j['state']}")
        if finals != 1:
            wrong.append(f"{finals} final events")
        if k["claimed"] != 1 or k["requeued"]:
            wrong.append(f"{k['claimed']} claims, {k['requeued']} requeued")
        if k["preempted"] != k["continued"] or k["preempted"] != j["preemptions"]:
            wrong.append(f"{k['preempted']} preempted, {k['continued']} continued, "
                         f"{j['preemptions']} counted")
        if wrong:
            problems[j["id"]] = f"{j['role']}: " + "; ".join(wrong)
    return {"jobs": len(jobs), "succeeded": sum(j["state"] == "succeeded" for j in jobs),
            "problems": problems, "ok": not problems, "preempted_by": preempted_by,
            "suspended_s": {i: v for i, v in suspended.items() if kinds[i]["continued"]}}


def p95(values: list[float]) -> float:
    """The 95th percentile, interpolated between the sorted values."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def makespan(batch: list[dict[str, Any]]) -> float:
    return max(j["finished_at"] for j in batch) - min(j["started_at"] for j in batch)


def summarise(solo: list[dict[str, Any]], alone: list[list[dict[str, Any]]],
              mixed: list[list[dict[str, Any]]], once: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures of one mode, each with what its bound was computed from.
    ``alone`` and ``mixed``: each round's jobs (the rounds ran alone, mixed, alone, mixed...);
    the interactive jobs of every round are pooled, the makespans compared round by round."""
    inter = [j for r in mixed for j in r if j["role"] == "interactive"]
    batch = [j for r in mixed for j in r if j["role"] == "batch"]
    solo_latency = statistics.median(j["latency_s"] for j in solo)
    solo_render = statistics.median(j["render_seconds"] for j in solo)
    step = statistics.mean(j["render_seconds"] / j["steps"] for r in alone for j in r)
    # Each round's mixed makespan over its bound from the alone makespan just before it; the
    # median round decides (the machine's speed drifts over minutes: a bound from another
    # round's alone figure would measure the drift).
    per_round = []
    for a, m in zip(alone, mixed, strict=True):
        n = sum(j["role"] == "interactive" for j in m)
        bound = 1.1 * (makespan(a) + n * solo_render)
        per_round.append({"alone_s": makespan(a), "mixed_s": makespan(
            [j for j in m if j["role"] == "batch"]), "bound_s": bound, "interactive": n})
    middle = sorted(per_round, key=lambda r: r["mixed_s"] / r["bound_s"])[len(per_round) // 2]
    alone_span, mixed_span = middle["alone_s"], middle["mixed_s"]
    wait = p95([j["wait_s"] for j in inter])
    latency = p95([j["latency_s"] for j in inter])
    # Once the group has taken it: claim -> end, against the same of the solo jobs.
    run = p95([j["render_seconds"] for j in inter])
    span_bound = middle["bound_s"]
    return {
        "solo": {"jobs": len(solo), "latency_s_median": solo_latency,
                 "render_s_median": solo_render,
                 "wait_s_median": statistics.median(j["wait_s"] for j in solo)},
        "batch_alone": {"makespan_s": alone_span, "step_s": step,
                        "render_s": [j["render_seconds"] for r in alone for j in r]},
        "mixed": {"interactive": len(inter), "makespan_s": mixed_span,
                  "claim_p95_s": p95([j["claim_s"] for j in inter]),
                  "first_step_unseen": sum(not j["first_step_seen"] for j in inter),
                  "took_replica_by_preemption": sum(j["id"] in once["preempted_by"]
                                                    for j in inter),
                  "batch_preemptions": [j["preemptions"] for j in batch],
                  "batch_suspended_s": [once["suspended_s"].get(j["id"], 0.0) for j in batch]},
        "wait": {"p95_s": wait, "bound_s": step + 1.0, "ok": wait <= step + 1.0},
        "latency": {"p95_s": latency, "bound_s": 2 * solo_latency,
                    "ok": latency <= 2 * solo_latency},
        "running": {"p95_s": run, "bound_s": 2 * solo_render, "solo_s_median": solo_render,
                    "ok": run <= 2 * solo_render},
        "makespan": {"mixed_s": mixed_span, "bound_s": span_bound, "alone_s": alone_span,
                     "interactive_solo_render_sum_s": middle["interactive"] * solo_render,
                     "rounds": per_round, "ok": mixed_span <= span_bound},
        "ended_once": {k: once[k] for k in ("jobs", "succeeded", "problems", "ok")},
        "as_specified": min(j["render_seconds"] for r in alone for j in r) >= SPEC_BATCH_SECONDS
        and all(r["interactive"] >= SPEC_INTERACTIVE for r in per_round),
    }


# ---- one mode ----------------------------------------------------------------------------------

def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    poll_s = args.poll_ms / 1e3
    rng = random.Random(args.seed)
    with service(mode, tmp) as svc:
        log(f"{mode}: warm-up")
        warm = run_phase(svc, batch=batch_body(args.batch, 2, name="warm-up"),
                         batch_role="warmup", poll_s=poll_s)
        for _ in range(2):
            warm += run_phase(svc, arrivals=[0.0], role="warmup", poll_s=poll_s)
        solo: list[Track] = []
        alone_rounds: list[list[dict[str, Any]]] = []
        mixed_rounds: list[list[dict[str, Any]]] = []
        arrivals_rounds = []
        for n in range(1, args.rounds + 1):
            log(f"{mode}: round {n}: {args.solo} solo interactive jobs")
            for _ in range(args.solo):
                solo += run_phase(svc, arrivals=[0.0], role="solo", poll_s=poll_s)
            log(f"{mode}: round {n}: two batch jobs of {args.batch} alone")
            alone = rows(svc, run_phase(svc, batch=batch_body(args.batch, name=f"alone-{n}"),
                                        batch_role="batch_alone", poll_s=poll_s))
            window = ARRIVAL_SHARE * makespan(alone)
            arrivals = [rng.uniform(0, window) for _ in range(args.interactive)]
            log(f"{mode}: round {n}: the batch again, {args.interactive} interactive jobs over "
                f"{window:.0f} s")
            mixed = run_phase(svc, batch=batch_body(args.batch, name=f"mixed-{n}"),
                              batch_role="batch", arrivals=arrivals, poll_s=poll_s)
            alone_rounds.append(alone)
            mixed_rounds.append(rows(svc, mixed))
            arrivals_rounds.append(sorted(arrivals))
        solo_rows = rows(svc, solo)
        every = [j for r in (*alone_rounds, *mixed_rounds) for j in r]
        # Every job counts for "ended once", the warm-up's too.
        once = ended_once(svc, rows(svc, warm) + solo_rows + every)
        out = summarise(solo_rows, alone_rounds, mixed_rounds, once)
        out["arrivals_s"] = arrivals_rounds
        out["jobs"] = solo_rows + every
        return out


# ---- output ------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_mode(mode: str, m: dict[str, Any]) -> None:
    s, a, x = m["solo"], m["batch_alone"], m["mixed"]
    w, lat, span, once = m["wait"], m["latency"], m["makespan"], m["ended_once"]
    run = m["running"]
    print(f"{mode}")
    print(f"  solo interactive ({s['jobs']} jobs, medians)  latency {s['latency_s_median']:.3f} s"
          f"  render {s['render_s_median']:.3f} s  wait {s['wait_s_median']:.3f} s")
    print(f"  batch alone ({len(a['render_s'])} jobs)  makespan {a['makespan_s']:.1f} s  "
          f"step {a['step_s']:.3f} s  render " + ", ".join(f"{r:.1f} s" for r in a["render_s"]))
    suspended = ", ".join(f"{v:.1f} s" for v in x["batch_suspended_s"])
    print(f"  mixed: {x['interactive']} interactive, {x['took_replica_by_preemption']} of them by "
          f"preemption; batch jobs preempted {x['batch_preemptions']} times, suspended "
          f"{suspended}; claim p95 {x['claim_p95_s']:.3f} s; first step unseen "
          f"{x['first_step_unseen']}")
    print(f"  wait submit->first step p95  {w['p95_s']:7.3f} s <= {w['bound_s']:7.3f} s "
          f"(batch step {a['step_s']:.3f} + 1)  {verdict(w['ok'])}")
    print(f"  interactive latency p95      {lat['p95_s']:7.3f} s <= {lat['bound_s']:7.3f} s "
          f"(2 x solo {s['latency_s_median']:.3f})  {verdict(lat['ok'])}")
    print(f"  ... claim->end p95           {run['p95_s']:7.3f} s <= {run['bound_s']:7.3f} s "
          f"(2 x solo {run['solo_s_median']:.3f})  {verdict(run['ok'])}")
    rounds = "; ".join(f"{r['mixed_s']:.1f} <= {r['bound_s']:.1f} (alone {r['alone_s']:.1f})"
                       for r in span["rounds"])
    print(f"  batch makespan, median round {span['mixed_s']:7.1f} s <= {span['bound_s']:7.1f} s "
          f"(1.1 x ({span['alone_s']:.1f} + {span['rounds'][0]['interactive']} x "
          f"{s['render_s_median']:.3f}))  {verdict(span['ok'])}")
    print(f"    rounds (alone, mixed in turn): {rounds}")
    print(f"  every job ended once         {once['succeeded']} of {once['jobs']} succeeded, "
          f"{len(once['problems'])} with problems  {verdict(once['ok'])}")
    for job_id, problem in once["problems"].items():
        print(f"    {job_id}: {problem}")
    print(f"  scenario as specified (batch >= {SPEC_BATCH_SECONDS:.0f} s, >= {SPEC_INTERACTIVE} "
          f"interactive): {'yes' if m['as_specified'] else 'no'}")


def _without_logs(args: list[str]) -> list[str]:
    """``args`` less ``--logs DIR`` (or ``--logs=DIR``)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--logs":
            skip = True
        elif not arg.startswith("--logs="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a small smoke run: {QUICK} unless given")
    parser.add_argument("--modes", default="allgather,rank_local")
    parser.add_argument("--batch", help=f"WxHxFRAMESxSTEPS (default {FULL['batch']})")
    parser.add_argument("--interactive", type=int, help=f"default {FULL['interactive']}")
    parser.add_argument("--solo", type=int, help=f"default {FULL['solo']}")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alone then mixed, this many times in turn (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--poll-ms", type=float, default=50.0)
    parser.add_argument("--json", type=Path, nargs="?", const=ROOT / "bench/results/overnight.json",
                        help="write the figures there (no PATH: bench/results/overnight.json)")
    parser.add_argument("--logs", type=Path,
                        help="keep each mode's API and worker logs in this folder")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODE_FLAGS):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODE_FLAGS)}")
    report: dict[str, Any] = {
        "batch": args.batch, "interactive": args.interactive, "solo": args.solo,
        "seed": args.seed, "poll_ms": args.poll_ms, "quick": args.quick, "rounds": args.rounds,
        "modes": {},
        # Where the logs were kept is this machine's, not the figures'.
        "command": "python bench/overnight.py " + " ".join(_without_logs(argv or sys.argv[1:]))}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kiln-overnight-") as tmp:
        for mode in modes:
            report["modes"][mode] = run_mode(mode, args, Path(tmp))
            if args.logs:
                kept = args.logs / mode
                kept.mkdir(parents=True, exist_ok=True)
                for name in ("api.log", "worker.log"):
                    shutil.copy(Path(tmp) / mode / name, kept / name)
    report["seconds"] = time.monotonic() - began
    report["load_average"] = os.getloadavg()
    print(f"overnight at dp=2: 2 batch jobs of {args.batch}, {args.interactive} interactive "
          f"jobs at kiln-tiny's defaults, seed {args.seed} ({report['seconds']:.0f} s)")
    holds = True
    for mode, m in report["modes"].items():
        print_mode(mode, m)
        holds &= all(m[k]["ok"] for k in ("wait", "latency", "running", "makespan", "ended_once"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if holds else 1


if __name__ == "__main__":
    raise SystemExit(main())
