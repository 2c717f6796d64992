"""Service overhead: submit -> succeeded latency minus the render time, for tiny jobs.

Starts the API (``kiln api`` on a free port) and a real worker group (``kiln worker --dp N``)
against the real Redis and a fresh database (a uniquely named PostgreSQL database, created from
the ``postgres`` maintenance database, migrated, and dropped at the end; or a SQLite file), then
submits tiny kiln-tiny jobs one after another and polls each every ``--poll-ms`` until it ends.

Per job it prints the total latency (POST sent -> succeeded seen), the render time the worker
wrote (``render_seconds``: claim -> finish, heartbeats and output writing included), the
overhead (total - render), and where that overhead went, from the row's own timestamps:

- ``submit_ms``: POST sent -> response received (validation, row, commit, Redis);
- ``queue_wait_ms``: ``created_at`` -> ``started_at`` (idle poll, claim);
- ``seen_lag_ms``: ``finished_at`` -> the poll that saw ``succeeded`` (poll interval, GET);
- ``in_worker_ms``: ``render_seconds`` minus the same job's bare compute in this process
  (prepare, steps, decode, MP4 + PNG), i.e. per-step heartbeats, lock-step plumbing, store.

Usage: python bench/service_latency.py [--backend postgresql|sqlite] [--dp 1,2] [--jobs 20]
       [--steps 2] [--poll-ms 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.procs import free_port, stop_group  # noqa: E402

KILN = str(Path(sys.executable).with_name("kiln"))
POSTGRES_URL = os.environ.get("KILN_BENCH_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
TERMINAL = {"succeeded", "failed", "cancelled", "dead", "expired"}


@contextlib.contextmanager
def fresh_database(backend: str, tmp: Path) -> Iterator[str]:
    """A migrated, empty database of ``backend``; a PostgreSQL one is dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    import migrations

    if backend == "sqlite":
        url = f"sqlite:///{tmp / 'kiln.db'}"
        migrations.upgrade(url)
        yield url
        return
    name = f"kiln_bench_{secrets.token_hex(4)}"
    # CREATE/DROP DATABASE cannot run inside a transaction, and not from the database itself.
    admin = create_engine(make_url(POSTGRES_URL).set(database="postgres"),
                          isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
        try:
            migrations.upgrade(url)
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def make_key(url: str) -> str:
    from storage.db import make_engine, make_session_factory
    from storage.users import create_api_key

    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            return create_api_key(session, "bench").key
    finally:
        engine.dispose()


@contextlib.contextmanager
def process(argv: list[str], env: dict[str, str], *, log: Path | None = None,
            stop_timeout: float = 30) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own process group, stopped with SIGINT (graceful), then SIGKILL; its
    output goes to ``log`` (appended, stderr with it), else to stderr, so that stdout carries
    only the figures."""
    with contextlib.ExitStack() as stack:
        out = (stack.enter_context(log.open("ab")) if log is not None else sys.stderr)
        proc = subprocess.Popen(argv, env=env, start_new_session=True, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT if log is not None else None)
    try:
        yield proc
    finally:
        stop_group(proc, timeout=stop_timeout)


def wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"the API at {url} did not become ready")


def _ts(value: str | None) -> float | None:
    return None if value is None else datetime.fromisoformat(value).timestamp()


def run_job(client: httpx.Client, body: dict[str, Any], poll_s: float,
            timeout: float = 120) -> dict[str, Any]:
    sent = time.time()
    r = client.post("/v1/jobs", json=body)
    answered = time.time()
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            seen = time.time()
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
        time.sleep(poll_s)
    assert job["status"] == "succeeded", job
    created, started, finished = (_ts(job[k]) for k in ("created_at", "started_at",
                                                         "finished_at"))
    assert created is not None and started is not None and finished is not None
    total = seen - sent
    render = job["render_seconds"]
    return {
        "id": job_id, "total_ms": 1e3 * total, "render_ms": 1e3 * render,
        "overhead_ms": 1e3 * (total - render), "submit_ms": 1e3 * (answered - sent),
        "queue_wait_ms": 1e3 * (started - created), "seen_lag_ms": 1e3 * (seen - finished),
    }


def bare_compute_seconds(body: dict[str, Any], dp: int, repeats: int = 5) -> float:
    """The median time this process takes for the job's own work, with a rank's thread count:
    prepare, every step, decode, MP4 and thumbnail into a temporary directory."""
    import torch

    from runtime.pipelines.base import VideoRequest
    from runtime.render import frames_to_uint8, load_pipeline
    from storage.video import write_outputs

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dp))
    pipe = load_pipeline("kiln-tiny")
    request = VideoRequest(prompt=body["prompt"], width=body["width"], height=body["height"],
                           num_frames=body["num_frames"],
                           num_inference_steps=body["num_inference_steps"],
                           seed=1)
    times = []
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
            for i in range(repeats + 1):
                start = time.perf_counter()
                state = pipe.prepare(request)
                while not state.done:
                    pipe.step(state)
                frames = frames_to_uint8(pipe.decode(state)).cpu().numpy()
                write_outputs(frames, Path(tmp) / f"{i}.mp4", fps=body["fps"])
                if i:  # the first run warms up
                    times.append(time.perf_counter() - start)
    finally:
        pipe.close()
        torch.set_num_threads(threads)
    return statistics.median(times)


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def summarize(rows: list[dict[str, Any]], bare_ms: float) -> dict[str, Any]:
    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in rows), 1)

    overhead = [r["overhead_ms"] for r in rows]
    return {
        "num_jobs": len(rows),
        "overhead_ms": {"median": round(statistics.median(overhead), 1),
                        "p90": round(_pct(overhead, 90), 1), "min": round(min(overhead), 1),
                        "max": round(max(overhead), 1)},
        "median_ms": {k: med(k) for k in ("total_ms", "render_ms", "submit_ms",
                                          "queue_wait_ms", "seen_lag_ms")},
        "bare_compute_ms": round(bare_ms, 1),
        "in_worker_ms_median": round(statistics.median(r["render_ms"] for r in rows) - bare_ms, 1),
    }


def bench_dp(dp: int, args: argparse.Namespace, db_url: str, key: str, tmp: Path) -> dict[str, Any]:
    import redis

    prefix = f"kiln-bench-{secrets.token_hex(3)}:"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KILN_DATABASE_URL": db_url, "REDIS_URL": args.redis_url,
           "KILN_REDIS_PREFIX": prefix, "KILN_OUTPUT_DIR": str(tmp / f"outputs-{dp}"),
           "KILN_MAX_QUEUED_JOBS_PER_USER": "100000", "KILN_ENVIRONMENT": "local"}
    body = {"prompt": "a red circle", "model": "kiln-tiny", "width": 64, "height": 64,
            "num_frames": 9, "num_inference_steps": args.steps, "fps": 8, "seed": 1}
    bare = bare_compute_seconds(body, dp)
    rows = []
    try:
        with process([KILN, "api", "--port", str(port)], env), \
                process([KILN, "worker", "--dp", str(dp)], env):
            wait_healthy(url)
            with httpx.Client(base_url=url, timeout=30,
                              headers={"Authorization": f"Bearer {key}"}) as client:
                for _ in range(args.warmup):  # model load, first claims, connection pools
                    run_job(client, body, args.poll_ms / 1e3, timeout=300)
                for _ in range(args.jobs):
                    rows.append(run_job(client, body, args.poll_ms / 1e3))
    finally:
        r = redis.Redis.from_url(args.redis_url)
        try:
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)
        finally:
            r.close()
    return {"dp": dp, **summarize(rows, 1e3 * bare),
            "jobs": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                     for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--dp", default="1", help="comma-separated group sizes, e.g. 1,2")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                               "redis://127.0.0.1:6379/0"))
    parser.add_argument("--per-job", action="store_true", help="also print every job's figures")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with fresh_database(args.backend, tmp) as db_url:
            key = make_key(db_url)
            for dp in (int(d) for d in args.dp.split(",")):
                result = bench_dp(dp, args, db_url, key, tmp)
                if not args.per_job:
                    result.pop("jobs")
                results.append(result)
    print(json.dumps({"backend": args.backend, "steps": args.steps, "poll_ms": args.poll_ms,
                      "load_average": os.getloadavg(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
