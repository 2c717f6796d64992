"""A REAL dp=2 run: the persistent worker group (``kiln worker --dp 2``, CPU ranks over gloo)
renders a mixed workload fed two ways, in ``--repeat`` pairs of runs (the median ratio is the
figure: this machine's speed drifts enough to move one pair by 0.2x).

- **kiln**: every job is queued at once; the group admits a job onto a rank at the first step
  boundary after that rank's job ends (``scheduler.claim.claim_for_group``).
- **waves**: the same group, but this driver queues two jobs at a time and the next two only when
  both have finished, so every wave waits for its longest job (its spare rank idles rather than
  repeating a request, which only flatters the waves).

Same jobs in the same order (steps from {4, 8, 16}, two sizes, seeded), SQLite and the real
Redis, outputs written as MP4 + thumbnail by the worker. Time runs from the first job's start
(the group's model load is left out) to the last job's end; queue wait is a job's start minus
that first start (every job is available from then on in both modes).

    python bench/scheduler_real.py [--jobs 40] [--seed 0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from sqlalchemy import select  # noqa: E402

import migrations  # noqa: E402
from scheduler import queue_index  # noqa: E402
from storage import submission  # noqa: E402
from storage.db import make_engine, make_session_factory  # noqa: E402
from storage.submission import JobSpec  # noqa: E402
from storage.tables import Job, JobState  # noqa: E402
from storage.users import get_or_create_user  # noqa: E402

KILN = str(Path(sys.executable).with_name("kiln"))
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SIZES = ((128, 128, 9), (256, 256, 17))


def specs(n: int, seed: int) -> list[JobSpec]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w, h, f = rng.choice(SIZES)
        out.append(JobSpec(model="kiln-tiny", prompt=f"shape number {i}", width=w, height=h,
                           num_frames=f, fps=8, num_inference_steps=rng.choice((4, 8, 16)),
                           guidance_scale=5.0, seed=i))
    return out


def run(mode: str, jobs: list[JobSpec], tmp: Path, r: redis.Redis) -> tuple[float, float]:
    url = f"sqlite:///{tmp / mode}.db"
    migrations.upgrade(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    prefix = f"kilnbench:{secrets.token_hex(4)}:"
    env = {**os.environ, "KILN_DATABASE_URL": url, "REDIS_URL": REDIS_URL,
           "KILN_REDIS_PREFIX": prefix, "KILN_OUTPUT_DIR": str(tmp / mode)}
    ids: list[str] = []

    def submit(batch: list[JobSpec]) -> None:
        with factory() as s:
            owner = get_or_create_user(s, "bench")
            s.commit()
            for spec in batch:
                job = submission.create_job(s, owner, spec, request_hash="b").job
                queue_index.add(r, prefix, [job])
                ids.append(job.id)

    def finished(job_ids: list[str]) -> bool:
        with factory() as s:
            states = list(s.scalars(select(Job.state).where(Job.id.in_(job_ids))))
        bad = [st for st in states if st not in (JobState.QUEUED, JobState.RUNNING,
                                                 JobState.SUCCEEDED)]
        if bad:
            raise SystemExit(f"a job ended {bad[0]}; see the worker's log")
        return all(st == JobState.SUCCEEDED for st in states)

    worker = subprocess.Popen([KILN, "worker", "--dp", "2"], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if mode == "kiln":
            submit(jobs)
            while not finished(ids):
                time.sleep(0.05)
        else:
            for start in range(0, len(jobs), 2):
                submit(jobs[start:start + 2])
                while not finished(ids[-2:]):
                    time.sleep(0.02)
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        worker.wait(timeout=120)
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            r.delete(*keys)
    with factory() as s:
        rows = list(s.scalars(select(Job).where(Job.id.in_(ids))))
    engine.dispose()
    t0 = min(j.started_at for j in rows)
    makespan = (max(j.finished_at for j in rows) - t0).total_seconds()
    waits = [(j.started_at - t0).total_seconds() for j in rows]
    return len(rows) / makespan * 3600.0, statistics.fmean(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3,
                        help="pairs of runs, each pair in the other order than the last")
    args = parser.parse_args()
    if args.jobs < 2 or args.repeat < 1:
        raise SystemExit("--jobs must be >= 2 and --repeat >= 1")
    jobs = specs(args.jobs, args.seed)
    r = redis.Redis.from_url(REDIS_URL)
    print(f"REAL run: kiln worker --dp 2 on CPU, {args.jobs} jobs, steps from (4, 8, 16), sizes "
          f"{' / '.join(f'{w}x{h}x{f}f' for w, h, f in SIZES)}, seed {args.seed}")
    # The machine's speed drifts over minutes: each pair runs both feedings back to back, and
    # alternates which goes first, so a drift does not favour one of them.
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            order = ("waves", "kiln") if i % 2 == 0 else ("kiln", "waves")
            print(f"pair {i + 1}:\n  {'feeding':<8} {'jobs/hour':>10} {'mean queue wait':>16}")
            results = {}
            pair_dir = Path(tmp) / str(i)
            pair_dir.mkdir()
            for mode in order:
                results[mode] = run(mode, jobs, pair_dir, r)
                rate, wait = results[mode]
                print(f"  {mode:<8} {rate:10.0f} {wait:14.2f} s")
            ratios.append(results["kiln"][0] / results["waves"][0])
            print(f"  kiln / waves throughput: {ratios[-1]:.2f}x")
    print(f"kiln / waves throughput over {len(ratios)} pair(s): median "
          f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
