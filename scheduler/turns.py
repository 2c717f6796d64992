"""Which replicas compute in a turn, and which of its jobs each one runs: time-slicing a group.

A worker group advances in turns, and a turn lasts as long as its slowest computing replica.
Beside a job whose step takes 14 s, a 4-step job of 35 ms steps would take a minute. So each
turn the group chooses, per replica, the one job it runs (a replica may hold several: a job it
suspended in place for an interactive one), and which replicas compute at all; a replica that
sits a turn out keeps its jobs' states and only joins the weight gathers, as an idle rank does.

The rules, applied by `choose_turn` to what the group holds (pure: no clock, no server):

1. On each replica the job to run is its interactive job before its batch job, then the one with
   the least work left (steps left x seconds per step): a job handed to a busy replica runs
   before the one it found there. A job that has waited ``max_pause_seconds`` goes first.
2. Every replica whose chosen job is interactive computes; so does every replica whose job costs
   at most ``1 + slack`` times the dearest interactive job's step (it does not slow the turn).
   With no interactive job running, every replica computes: batch work alone is paced for
   throughput, and a turn of two batch steps is shorter than two turns of one.
3. A dearer batch job sits out, but never for more than ``max_pause_seconds`` in a row: then it
   computes in the next turn whatever runs beside it. That bounds what batch work loses to a
   stream of interactive jobs; aging in the queue bounds the rest.

Seconds per step are measured (a job's own compute time over the steps it ran) once the job has
run a step; before that the cost model's estimate is scaled by how far off it was for the jobs
that have (`calibrated`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from scheduler.policy import BATCH, INTERACTIVE

# A batch job no dearer than this share above the interactive step beside it computes with it.
DEFAULT_SLACK = 0.25
# The longest a batch job sits out in a row, whatever interactive work keeps arriving.
DEFAULT_MAX_PAUSE_SECONDS = 30.0


@dataclass(kw_only=True, slots=True)
class HeldJob:
    """A job a replica holds (running or suspended), as the turn choice sees it."""

    job_id: str
    replica: int  # its replica's first rank
    job_class: str  # "interactive" | "batch"
    seconds_per_step: float  # the cost model's estimate, in its own scale
    steps_left: int
    order: int  # when its replica took it (a counter): later wins a tie
    paused_seconds: float = 0.0  # how long it has sat out in a row (turns it did not compute)
    measured: float | None = None  # its own seconds per step, once it has run one

    @property
    def work_left(self) -> float:
        return self.steps_left * (self.measured or self.seconds_per_step)


def calibrated(held: list[HeldJob]) -> list[HeldJob]:
    """``held`` with every job's cost in measured seconds: a job that has not run a step yet
    is given its estimate times the median measured/estimated ratio of the jobs that have (an
    untrained cost model's guess is right in ratio only, not in seconds)."""
    ratios = sorted(j.measured / j.seconds_per_step for j in held
                    if j.measured and j.seconds_per_step > 0)
    scale = ratios[len(ratios) // 2] if ratios else 1.0
    return [replace(j, measured=j.measured or j.seconds_per_step * scale) for j in held]


@dataclass(kw_only=True, slots=True)
class TurnConfig:
    slack: float = DEFAULT_SLACK
    max_pause_seconds: float = DEFAULT_MAX_PAUSE_SECONDS

    def __post_init__(self) -> None:
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")
        if self.max_pause_seconds < 0:
            raise ValueError(f"max_pause_seconds must be >= 0, got {self.max_pause_seconds}")


@dataclass(slots=True)
class Turn:
    # replica -> id of the job it computes this turn (replicas holding nothing are absent)
    run: dict[int, str] = field(default_factory=dict)
    # replicas holding jobs that sit this turn out (they join the gathers without computing)
    pause: set[int] = field(default_factory=set)
    # job id -> why it does not compute this turn (suspended behind another job, or paused)
    waiting: dict[str, str] = field(default_factory=dict)


def _class_rank(job: HeldJob) -> int:
    return 0 if job.job_class == INTERACTIVE else 1


def choose_turn(held: Iterable[HeldJob], config: TurnConfig | None = None, *,
                shared: bool = True) -> Turn:
    """The turn's choice for the jobs the group holds (see the module docstring). ``shared``
    False: the replicas keep their own pace (no turn is shared: a replica's step never waits
    for another's), so only rule 1 applies and every replica holding a job computes."""
    config = config or TurnConfig()
    by_replica: dict[int, list[HeldJob]] = {}
    for job in calibrated(list(held)):
        by_replica.setdefault(job.replica, []).append(job)
    turn = Turn()
    chosen: dict[int, HeldJob] = {}
    for replica, jobs in by_replica.items():
        first = min(jobs, key=lambda j: (j.paused_seconds < config.max_pause_seconds,
                                          _class_rank(j), j.work_left, -j.order))
        chosen[replica] = first
        for job in jobs:
            if job is not first:
                turn.waiting[job.job_id] = f"suspended for job {first.job_id}"
    interactive = [j.measured or 0.0 for j in chosen.values() if j.job_class == INTERACTIVE]
    bound = max(interactive) * (1 + config.slack) if interactive and shared else None
    for replica, job in chosen.items():
        computes = (bound is None or job.job_class == INTERACTIVE
                    or (job.measured or 0.0) <= bound
                    or job.paused_seconds >= config.max_pause_seconds)
        if computes:
            turn.run[replica] = job.job_id
        else:
            turn.pause.add(replica)
            turn.waiting[job.job_id] = "paused while cheaper interactive work runs"
    return turn


def preempt_target(held: Iterable[HeldJob], replicas: Iterable[int], *,
                   max_jobs_per_replica: int, config: TurnConfig | None = None) -> int | None:
    """The replica an interactive job should be handed to when none is free: the one running
    the batch job with the most work left, among replicas that hold no interactive job, have
    room for one more job's state, and hold no batch job that has already waited
    ``max_pause_seconds`` (it runs next: no batch job is suspended without end); None when no
    replica qualifies."""
    config = config or TurnConfig()
    by_replica: dict[int, list[HeldJob]] = {r: [] for r in replicas}
    for job in calibrated(list(held)):
        if job.replica in by_replica:
            by_replica[job.replica].append(job)
    best: tuple[float, int] | None = None
    for replica, jobs in by_replica.items():
        if not jobs or len(jobs) >= max_jobs_per_replica:
            continue
        if any(j.job_class != BATCH or j.paused_seconds >= config.max_pause_seconds
               for j in jobs):
            continue
        work = max(j.work_left for j in jobs)
        if best is None or work > best[0]:
            best = (work, replica)
    return None if best is None else best[1]
