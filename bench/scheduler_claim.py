"""One claim at scale: ``claim_for_group`` (the policy's ``schedule`` plus the atomic claim) with
100,000 queued jobs from 100 users, on a real database and Redis.

The queue is written in bulk (rows straight into ``jobs``, then ``scheduler.queue_index.add`` as
the API would), skewed like real use: user k holds a share of the jobs proportional to 1/(k+1),
so the heaviest user has ~19,000 and the lightest ~190; 80% batch, 20% interactive, priorities 0-9,
two sizes, steps from {4, 8, 16}, a few with a future ``not_before`` or a deadline. Then a dp=2
group claims for one free rank at a time (what a step boundary usually frees), finishing each job
it gets (``finish_succeeded`` and ``scheduler.claim.record_result``), while a few new jobs
arrive every ten claims. Printed: the time of the first call (which reconciles the index with
the database, as on a fresh Redis), the median / p90 / p99 time of one call afterwards, and the
Redis index (keys, bytes, entries against queued jobs in the database) before and after.

    python bench/scheduler_claim.py [--jobs 100000] [--users 100] [--claims 500]
        [--backend postgresql|sqlite] [--database-url URL] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from sqlalchemy import create_engine, func, insert, make_url, select, text  # noqa: E402

import migrations  # noqa: E402
import scheduler.claim  # noqa: E402
from scheduler import queue_index  # noqa: E402
from scheduler.claim import claim_for_group, job_tokens, record_result  # noqa: E402
from storage import lifecycle, submission  # noqa: E402
from storage.db import make_engine, make_session_factory  # noqa: E402
from storage.submission import JobSpec, new_job_id  # noqa: E402
from storage.tables import Job, JobState, User  # noqa: E402

POSTGRES_URL = os.environ.get("KILN_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "kiln-tiny"
SIZES = ((128, 128, 9), (256, 256, 17))


def fill(session_factory, r: redis.Redis, prefix: str, num_jobs: int, num_users: int,
         now: datetime, rng: random.Random) -> None:
    with session_factory() as s:
        users = [User(name=f"user{k}") for k in range(num_users)]
        s.add_all(users)
        s.commit()
        weights = [1.0 / (k + 1) for k in range(num_users)]
        rows = []
        for i in range(num_jobs):
            owner = rng.choices(users, weights)[0]
            w, h, f = rng.choice(SIZES)
            created = now - timedelta(seconds=num_jobs - i)
            rows.append(dict(
                id=new_job_id(), owner_id=owner.id, model=MODEL, prompt="a red circle",
                width=w, height=h, num_frames=f, fps=8,
                num_inference_steps=rng.choice((4, 8, 16)), guidance_scale=5.0,
                seed=rng.randrange(2**31), class_="batch" if rng.random() < 0.8 else "interactive",
                priority=rng.randrange(10),
                not_before=now + timedelta(hours=1) if rng.random() < 0.02 else None,
                deadline=now + timedelta(hours=8) if rng.random() < 0.05 else None,
                meta={}, request_hash="bench", state=JobState.QUEUED.value, attempts=0,
                max_attempts=3, progress_step=0, progress_total=4, cancel_requested=False,
                created_at=created))
        for start in range(0, len(rows), 5000):
            s.execute(insert(Job), rows[start:start + 5000])
        s.commit()
        for start in range(0, num_jobs, 5000):
            ids = [row["id"] for row in rows[start:start + 5000]]
            queue_index.add(r, prefix, s.scalars(select(Job).where(Job.id.in_(ids))))
        s.rollback()


def index_report(r: redis.Redis, prefix: str, session_factory) -> str:
    keys = queue_index.index_keys(r, prefix)
    ready_bytes = queue_index.memory_bytes(r, queue_index.ready_keys(prefix))
    entries = r.hlen(queue_index.jobs_key(prefix))
    with session_factory() as s:
        queued = s.scalar(select(func.count()).select_from(Job).where(
            Job.state == JobState.QUEUED))
    sched_bytes = queue_index.memory_bytes(r, keys)
    per_job = sched_bytes / entries if entries else 0.0
    return (f"batcher index: {len(keys)} keys, {sched_bytes / 2**20:.1f} MiB "
            f"({per_job:.0f} B per entry), {entries} entries for {queued} queued jobs in the "
            f"database; serving-order keys (ready:*): {ready_bytes / 2**20:.1f} MiB")


class TimedClaims:
    """Wraps storage.lifecycle.claim_job as the claim path sees it, to split a call's time into the
    database transition and the rest (Redis and the policy)."""

    def __init__(self) -> None:
        self.inner = scheduler.claim.claim_job
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def run(url: str, r: redis.Redis, args: argparse.Namespace) -> dict:
    """Fill the queue, time the claims; print the figures and return them."""
    engine = make_engine(url)
    factory = make_session_factory(engine)
    prefix = f"kilnbench:{secrets.token_hex(4)}:"
    rng = random.Random(args.seed)
    now = datetime.now(UTC)
    try:
        start = time.perf_counter()
        fill(factory, r, prefix, args.jobs, args.users, now, rng)
        fill_seconds = time.perf_counter() - start
        print(f"wrote {args.jobs} queued jobs from {args.users} users in {fill_seconds:.1f} s")
        times: list[float] = []
        db_times: list[float] = []
        timed = TimedClaims()
        scheduler.claim.claim_job = timed
        first = None
        with factory() as s:
            owner = s.scalar(select(User).where(User.name == "user1"))
            assert owner is not None
            for i in range(args.claims + 1):
                t = time.perf_counter()
                timed.seconds = 0.0
                claims = claim_for_group(s, r, prefix=prefix, group_id="bench", model=MODEL,
                                         free_ranks=[i % 2], lease_seconds=120)
                elapsed = time.perf_counter() - t
                if first is None:
                    first = elapsed
                    print(f"first call (reconciles the index with the database): "
                          f"{first:.2f} s")
                    print("  " + index_report(r, prefix, factory))
                else:
                    times.append(elapsed)
                    db_times.append(timed.seconds)
                for _, c in claims:  # the rank renders it at once and finishes
                    lifecycle.finish_succeeded(s, c.job.id, c.attempt_token, video_key="v")
                    record_result(r, prefix=prefix, job_id=c.job.id, model=MODEL,
                                  num_tokens=job_tokens(c.job),
                                  num_inference_steps=c.job.num_inference_steps,
                                  render_seconds=0.05 * c.job.num_inference_steps)
                if i % 10 == 0:  # submissions keep arriving through the API path
                    for _ in range(5):
                        created = submission.create_job(
                            s, owner, JobSpec(model=MODEL, prompt="new", width=128, height=128,
                                              num_frames=9, fps=8, num_inference_steps=8,
                                              guidance_scale=5.0), request_hash="b").job
                        queue_index.add(r, prefix, [created])
        q = statistics.quantiles(times, n=100)
        print(f"one claim_for_group (schedule + claim, 1 free rank) over {len(times)} calls: "
              f"median {statistics.median(times) * 1e3:.2f} ms, p90 {q[89] * 1e3:.2f} ms, "
              f"p99 {q[98] * 1e3:.2f} ms (target: median <= 5 ms)")
        rest = [a - b for a, b in zip(times, db_times, strict=True)]
        with factory() as s:  # the floor this machine sets: one logged write and its commit
            floor = []
            for _ in range(50):
                t = time.perf_counter()
                s.execute(text("UPDATE users SET disabled = disabled WHERE name = 'user0'"))
                s.commit()
                floor.append(time.perf_counter() - t)
        print(f"  of which the database transition (claim_job: UPDATE + event + COMMIT): median "
              f"{statistics.median(db_times) * 1e3:.2f} ms; Redis index + policy: median "
              f"{statistics.median(rest) * 1e3:.2f} ms; a one-row UPDATE + COMMIT here: median "
              f"{statistics.median(floor) * 1e3:.2f} ms")
        print("  " + index_report(r, prefix, factory))
        with factory() as s:
            rec = queue_index.reconcile(s, r, prefix)
        print(f"  reconcile afterwards: {rec.added} queued jobs were missing from the index, "
              f"{rec.removed} stale entries")
        return {"jobs": args.jobs, "users": args.users, "calls": len(times),
                "fill_seconds": round(fill_seconds, 2), "first_call_seconds": first,
                "median_ms": statistics.median(times) * 1e3, "p90_ms": q[89] * 1e3,
                "p99_ms": q[98] * 1e3, "database_median_ms": statistics.median(db_times) * 1e3,
                "index_and_policy_median_ms": statistics.median(rest) * 1e3,
                "one_row_commit_median_ms": statistics.median(floor) * 1e3,
                "reconcile_added": rec.added, "reconcile_removed": rec.removed}
    finally:
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 1000):
            r.delete(*keys[start:start + 1000])
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--database-url", help="an empty, migrated database (default: a fresh "
                        "one, dropped afterwards)")
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.jobs < 1 or args.users < 2 or args.claims < 2:
        raise SystemExit("--jobs must be >= 1, --users and --claims >= 2")
    r = redis.Redis.from_url(args.redis_url)
    print(f"{args.backend}, Redis {r.info('server')['redis_version']}")
    if args.database_url:
        figures = run(args.database_url, r, args)
    elif args.backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/kiln.db"
            migrations.upgrade(url)
            figures = run(url, r, args)
    else:
        name = f"kiln_bench_{secrets.token_hex(4)}"
        admin = create_engine(make_url(POSTGRES_URL).set(database="postgres"),
                              isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
            migrations.upgrade(url)
            figures = run(url, r, args)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, **figures}, indent=1))


if __name__ == "__main__":
    main()
