"""kiln's admission at step boundaries against DP waves, dp=2: a discrete-event SIMULATION
driven by step times MEASURED on the real kiln-tiny pipeline.

First the real pipeline (``runtime.render.load_pipeline("kiln-tiny")``, one CPU thread) is timed
at each job size: ``prepare``, ``pipe.step`` (median of several steps) and ``decode``, plus
``pipe.idle_step`` (a rank without a job). Then the same mixed workload (steps drawn from
{4, 8, 16}, two sizes, a few users) runs through two simulated schedulers on one group of
``--dp`` ranks in lock-step, where every step lasts as long as the slowest rank's step:

- **waves** (vLLM-Omni): take the next ``dp`` jobs in submission order; the wave lasts until its
  longest job ends (a rank whose job ended, or a short wave's spare rank, waits: its requests are
  repeated or it idles), then the next wave starts.
- **waves, same size** (a stronger baseline than vLLM-Omni's): a wave is the oldest waiting job
  plus the oldest waiting jobs of the same size, so sizes do not mix within a wave.
- **kiln**: `scheduler.policy.Policy` admits a job onto a rank at the first step boundary after
  that rank's job ends, while the others go on; a rank with no job only takes part in the
  gathers. ``kiln (no grouping)`` is the same with ``cost_window=1`` (oldest first within a
  user), to show what cost-aware grouping adds.

At each boundary a rank that finishes a job decodes it and a rank that starts one prepares it;
both are local work the other ranks wait for (the gathers need every rank), so the boundary
costs the largest of those. Two scenarios: a backlog (every job submitted at once: throughput)
and Poisson arrivals at ``--load`` of the waves' capacity (queue wait when the queue is short).

    python bench/scheduler_sim.py [--jobs 240] [--dp 2] [--seed 0] [--load 0.8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.families import family_of  # noqa: E402
from scheduler.cost import CostModel, tokens  # noqa: E402
from scheduler.policy import (  # noqa: E402
    BATCH,
    JobResult,
    Policy,
    PolicyConfig,
    QueuedJob,
    RunningJob,
)

MODEL = "kiln-tiny"
FAMILY = family_of(MODEL)
STEPS = (4, 8, 16)


@dataclass(frozen=True, slots=True)
class Size:
    width: int
    height: int
    num_frames: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}f"


@dataclass(frozen=True, slots=True)
class Timing:
    prepare: float
    step: float
    decode: float


@dataclass(frozen=True, slots=True)
class SimJob:
    job_id: str
    owner: str
    size: Size
    num_inference_steps: int
    arrival: float


@dataclass(slots=True)
class Outcome:
    makespan: float
    waits: list[float]

    def jobs_per_hour(self) -> float:
        return len(self.waits) / self.makespan * 3600.0

    def mean_wait(self) -> float:
        return statistics.fmean(self.waits)


def measure(sizes: list[Size], num_inference_steps: int) -> tuple[dict[Size, Timing], float]:
    import torch

    from runtime.pipelines.base import VideoRequest
    from runtime.render import load_pipeline

    torch.set_num_threads(1)
    pipe = load_pipeline(MODEL)
    out = {}
    for size in sizes:
        request = VideoRequest(prompt="a red circle moving left", width=size.width,
                               height=size.height, num_frames=size.num_frames,
                               num_inference_steps=num_inference_steps + 1)
        start = time.perf_counter()
        state = pipe.prepare(request)
        prepare = time.perf_counter() - start
        pipe.step(state)  # warm-up: first-touch allocations
        steps = []
        for _ in range(num_inference_steps):
            start = time.perf_counter()
            pipe.step(state)
            steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        pipe.decode(state)
        decode = time.perf_counter() - start
        out[size] = Timing(prepare=prepare, step=statistics.median(steps), decode=decode)
    idles = []
    for _ in range(num_inference_steps):
        start = time.perf_counter()
        pipe.idle_step()
        idles.append(time.perf_counter() - start)
    pipe.close()
    return out, statistics.median(idles)


def workload(n: int, sizes: list[Size], seed: int, mean_gap: float | None) -> list[SimJob]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        if mean_gap is not None:
            t += rng.expovariate(1.0 / mean_gap)
        jobs.append(SimJob(job_id=f"j{i}", owner=f"user{rng.randrange(4)}",
                           size=rng.choice(sizes), num_inference_steps=rng.choice(STEPS),
                           arrival=t))
    return jobs


def simulate_waves(jobs: list[SimJob], dp: int, timing: dict[Size, Timing],
                   idle: float, same_size: bool = False) -> Outcome:
    t, waits = 0.0, []
    queue = list(jobs)  # in submission order
    while queue:
        t = max(t, queue[0].arrival)
        due = [j for j in queue if j.arrival <= t]
        if same_size:
            due = [j for j in due if j.size == due[0].size]
        wave = due[:dp]
        taken = {j.job_id for j in wave}
        queue = [j for j in queue if j.job_id not in taken]
        waits += [t - j.arrival for j in wave]
        t += max(timing[j.size].prepare for j in wave)
        # A short wave repeats requests on its spare ranks: they cost as much as the slowest.
        for k in range(max(j.num_inference_steps for j in wave)):
            t += max([timing[j.size].step if k < j.num_inference_steps else idle for j in wave])
        t += max(timing[j.size].decode for j in wave)
    return Outcome(makespan=t, waits=waits)


def simulate_kiln(jobs: list[SimJob], dp: int, timing: dict[Size, Timing], idle: float,
                  config: PolicyConfig) -> Outcome:
    costs = CostModel()
    for size, tm in timing.items():  # the history a running service would have learned
        for _ in range(3):
            costs.observe(MODEL, tokens(size.width, size.height, size.num_frames, family=FAMILY),
                          tm.step)
    policy = Policy(config, costs)
    by_id = {j.job_id: j for j in jobs}
    ranks: list[list | None] = [None] * dp  # [job, steps left]
    waits: list[float] = []
    t, i, done = 0.0, 0, 0
    pending_decode = [0.0] * dp
    while done < len(jobs):
        while i < len(jobs) and jobs[i].arrival <= t:
            j = jobs[i]
            policy.add(QueuedJob(job_id=j.job_id, owner=j.owner, model=MODEL, job_class=BATCH,
                                 priority=5, due=j.arrival,
                                 num_tokens=tokens(j.size.width, j.size.height,
                                                   j.size.num_frames, family=FAMILY),
                                 num_inference_steps=j.num_inference_steps))
            i += 1
        boundary = list(pending_decode)
        pending_decode = [0.0] * dp
        free = [r for r in range(dp) if ranks[r] is None]
        if free and len(policy):
            running = [RunningJob(job_id=s[0].job_id, rank=r, model=MODEL,
                                  cost_per_step=timing[s[0].size].step, steps_left=s[1])
                       for r, s in enumerate(ranks) if s is not None]
            plan = policy.schedule(free, model=MODEL, running=running, now=t)
            for rank, job_id in plan.assignments.items():
                job = by_id[job_id]
                ranks[rank] = [job, job.num_inference_steps]
                waits.append(t - job.arrival)
                boundary[rank] += timing[job.size].prepare
        t += max(boundary)
        if all(s is None for s in ranks):
            if i < len(jobs):
                t = max(t, jobs[i].arrival)
            continue
        t += max(timing[s[0].size].step if s is not None else idle for s in ranks)
        for r, s in enumerate(ranks):
            if s is None:
                continue
            s[1] -= 1
            if s[1] == 0:
                job = s[0]
                pending_decode[r] = timing[job.size].decode
                policy.update_from_output([JobResult(
                    job_id=job.job_id, model=MODEL,
                    num_tokens=tokens(job.size.width, job.size.height, job.size.num_frames,
                                      family=FAMILY),
                    num_inference_steps=job.num_inference_steps,
                    render_seconds=job.num_inference_steps * timing[job.size].step)])
                ranks[r] = None
                done += 1
    t += max(pending_decode)
    return Outcome(makespan=t, waits=waits)


def parse_size(text: str) -> Size:
    w, h, f = (int(x) for x in text.lower().rstrip("f").split("x"))
    return Size(w, h, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=0.8,
                        help="arrival rate of the second scenario, as a share of the waves' "
                             "throughput in the backlog scenario")
    parser.add_argument("--sizes", nargs=2, type=parse_size,
                        default=[Size(128, 128, 9), Size(256, 256, 17)],
                        help="two sizes WxHxF (kiln-tiny: multiples of 16, 1+4k frames)")
    parser.add_argument("--measure-steps", type=int, default=5)
    args = parser.parse_args()
    if args.dp < 1 or args.jobs < 1 or not 0 < args.load:
        raise SystemExit("--dp and --jobs must be >= 1 and --load > 0")

    print("SIMULATION driven by step times measured on the real kiln-tiny pipeline "
          "(CPU, 1 thread):")
    timing, idle = measure(args.sizes, args.measure_steps)
    for size, tm in timing.items():
        num_tokens = tokens(size.width, size.height, size.num_frames, family=FAMILY)
        print(f"  {size!s:>14} ({num_tokens:5d} tokens): "
              f"prepare {tm.prepare * 1e3:7.1f} ms, step {tm.step * 1e3:7.1f} ms, "
              f"decode {tm.decode * 1e3:7.1f} ms")
    print(f"  {'idle rank':>14}: step {idle * 1e3:7.1f} ms (gathers only)")
    print(f"workload: {args.jobs} jobs, steps from {STEPS}, sizes {args.sizes[0]} / "
          f"{args.sizes[1]} at random, 4 users, dp={args.dp}, seed {args.seed}")

    backlog = workload(args.jobs, args.sizes, args.seed, None)
    waves = simulate_waves(backlog, args.dp, timing, idle)
    gap = 3600.0 / waves.jobs_per_hour() / args.load
    arrivals = workload(args.jobs, args.sizes, args.seed, gap)
    schedulers = {
        "waves": lambda jobs: simulate_waves(jobs, args.dp, timing, idle),
        "waves, same size": lambda jobs: simulate_waves(jobs, args.dp, timing, idle,
                                                        same_size=True),
        "kiln": lambda jobs: simulate_kiln(jobs, args.dp, timing, idle, PolicyConfig()),
        "kiln (no grouping)": lambda jobs: simulate_kiln(jobs, args.dp, timing, idle,
                                                         PolicyConfig(cost_window=1)),
    }
    for title, jobs in (("backlog (all submitted at t=0)", backlog),
                        (f"Poisson arrivals, one every {gap:.2f} s on average "
                         f"({args.load:.0%} of the waves' throughput)", arrivals)):
        print(f"\n{title}:")
        print(f"  {'scheduler':<20} {'jobs/hour':>10} {'mean queue wait':>16} {'vs waves':>9}")
        base = None
        for name, run in schedulers.items():
            out = run(jobs)
            base = base or out
            print(f"  {name:<20} {out.jobs_per_hour():10.0f} {out.mean_wait():14.2f} s "
                  f"{out.jobs_per_hour() / base.jobs_per_hour():8.2f}x")


if __name__ == "__main__":
    main()
