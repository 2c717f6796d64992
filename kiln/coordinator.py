"""Rank 0's coordinator: what every replica of the worker group does next.

The ranks run `runtime.rank_loop` turn by turn; rank 0 also runs the `Coordinator`, as vLLM v1's
engine core is to its workers, in three parts a turn:

- **plan** (`Coordinator.next_plan`): from what it holds in memory, a `StepPlan`: jobs claimed
  for free replicas (or, when none is free and an interactive job is due, for the replica whose
  batch job it suspends), cancels, hand-backs, which replicas compute (`scheduler.turns`), stop;
- **execute**: every rank carries the plan out (`runtime.rank_loop.RankLoop`);
- **update** (`Coordinator.record`): from what the ranks report, progress and lease renewal, the
  jobs' ends, the ranks' output stores, the group's report.

Every call outside its memory goes through one `kiln.group_io.GroupIO` handed in (the servers
in the service, memory in its tests), and every clock it reads is ``clock``: its decisions are
tested without a server or a process (tests/worker/test_coordinator.py).

A server that is out is an outage, not an error: the group reports itself degraded, pauses its
claims with a backoff, keeps its jobs going and their final transitions for later, and hands
back the claims whose answer the outage lost once the servers are back.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from common import logs, retry
from kiln.config import WorkerConfig
from kiln.group_io import Claimed, GroupIO
from runtime.rank_loop import (
    Ended,
    Progress,
    RankMessage,
    RankReport,
    Rendered,
    StepPlan,
    Ticket,
    leaves_steps_part_way,
)
from runtime.sequence import Layout
from scheduler.attempts import Ending
from scheduler.cost import CostModel
from scheduler.policy import GOAL_PREFERS, INTERACTIVE, RunningJob
from scheduler.turns import HeldJob, TurnConfig, choose_turn, preempt_target
from storage.outages import describe, is_outage
from storage.tables import JobState
from storage.workers import GroupReport

log = logging.getLogger(__name__)


def job_log(event: str, *, job: str, attempt: int | None = None, replica: int | None = None,
            **fields: object) -> None:
    """One line per job event: the event's name, with the job, its attempt, the replica it is
    on (named by its first rank) and the event's own figures as the line's fields
    (`common.logs`), so that one job's life can be followed by its id:
    ``... rank=0 job=j1 attempt=1 claimed replica=1 group=...``."""
    log.info(event, extra=logs.fields(job=job, attempt=attempt, replica=replica, **fields))


def new_group_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


# While a server is out, claims pause for a backoff that doubles up to this.
MAX_BACKOFF_SECONDS = 10.0
# On the way out, how long the group keeps trying to hand its jobs back through an outage.
GIVE_BACK_SECONDS = 5.0
# Why a job leaves its rank when the drain is over: its ranks checkpoint it on the way out.
HANDED_BACK = "handed back: the worker group stopped"
LEASE_LOST = "the lease of this attempt was lost"
# Jobs a replica may hold at once: the one it runs and one it suspended for an interactive job.
MAX_JOBS_PER_REPLICA = 2
# In lock-step, a batch step that gathers weights is left part-way for an interactive job
# (`StepPlan.leavable`, `Coordinator.leave_step`). An exact job keeps the blocks its step
# computed (`runtime.step_replay`) and loses at most the one it was inside, so its step is left
# as soon as the interactive job is due, however little of it is left (the estimate of what is
# left counts the job's compute, not the turn around it, and waiting for "the last 0.1 s" cost
# the overnight scenario's slowest interactive jobs 0.1 to 0.18 s each). A caching job's step
# loses all it ran: it is left only while more of it is left than this and than it has run, so
# it is never left at a cost above the wait it saves.
LEAVE_MIN_SECONDS = 0.1
# What a batch job may lose to steps left part-way, as a share of its whole render's compute
# (its steps x its seconds per step): past it, its steps are no longer left. Half the tenth a
# batch makespan may grow by beside interactive work, the rest being the interactive jobs' own
# time and the turns around them.
LEAVE_BUDGET = 0.05
# The longest rank 0 goes between two looks at the queue in a leavable step (each is one
# round trip to Redis; the look is made only at a block boundary).
LEAVE_LOOK_SECONDS = 0.005
# At their own pace, how long the coordinator waits for a held replica to say it waits at its
# step boundary before it may hold one again (the replica's own hold lapses sooner).
HOLD_RETRY_SECONDS = 1.0
# A job that sits turns out has its heartbeat (its step, a cancel request) at most this often,
# not every turn: the turns it waits through are the short turns of the job it waits for. The
# lease thread keeps its lease meanwhile.
PAUSED_BEAT_SECONDS = 1.0


@dataclass(kw_only=True, slots=True)
class Holding:
    """A job the group holds on one of its replicas, running or suspended."""

    ticket: Ticket
    replica: int  # the replica's first rank
    job_class: str
    seconds_per_step: float  # the cost model's estimate
    steps_left: int
    measured: float | None = None  # its own seconds per step, once it has run one
    order: int  # when the replica took it (a counter of the group's claims)
    waiting_since: float | None = None  # by the clock, while it does not compute
    suspended_by: str | None = None  # the job it is suspended for (its replica runs that one)
    resume_noted: bool = False
    lost_seconds: float = 0.0  # its compute lost to steps left part-way (`leave_step`)

    def held_job(self, now: float) -> HeldJob:
        waited = 0.0 if self.waiting_since is None else now - self.waiting_since
        return HeldJob(job_id=self.ticket.job_id, replica=self.replica,
                       job_class=self.job_class, seconds_per_step=self.seconds_per_step,
                       steps_left=self.steps_left, order=self.order, paused_seconds=waited,
                       measured=self.measured)

    @property
    def steps_done(self) -> int:
        return self.ticket.request.num_inference_steps - self.steps_left


class LeaseKeeper:
    """Rank 0's thread that keeps the group's leases: the leases follow the group, not the step.

    Every ``lease_seconds / 4`` it renews the lease of every attempt the group holds (running or
    writing its files), so a step longer than the lease costs nothing; a lease lapses only when
    the group is gone. An attempt found no longer current (the reaper took it, a user deleted it)
    lands in ``ended`` for the coordinator to drop at the next step boundary. Once a stop's drain
    deadline passes it hands every attempt back, uncharged, from this thread: a step that runs
    past the deadline does not hold the job.
    """

    def __init__(self, coordinator: Coordinator, lease_seconds: float) -> None:
        self.coordinator = coordinator
        self.interval_seconds = max(0.5, lease_seconds / 4)
        # job id -> attempt token; replaced whole by the loop's thread, read by this one.
        self._attempts: dict[str, str] = {}
        # attempt token -> why that attempt ended outside the loop (by token: the same job may
        # come back to this group in a later attempt)
        self.ended: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-leases", daemon=True)

    def track(self, running: Iterable[Ticket], *held: dict[str, Rendered] | dict[str, Ended]
              ) -> None:
        """The attempts to keep: ``running`` (running or suspended on a replica), and those
        whose files are being written or whose final transition waits (``held``: job id ->
        its message)."""
        attempts = {t.job_id: t.attempt_token for t in running}
        for messages in held:
            attempts.update((job_id, m.attempt_token) for job_id, m in messages.items())
        self._attempts = attempts

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self._until_next_tick()):
            try:
                self.tick()
            except Exception:  # the database may be down: the next tick tries again
                log.warning("worker group %s: could not renew leases",
                            self.coordinator.group_id, exc_info=True)

    def tick(self) -> None:
        """Renews every lease the group holds, or hands them all back once the drain is over."""
        attempts = {j: t for j, t in self._attempts.items() if t not in self.ended}
        if not attempts:
            return
        c = self.coordinator
        if c.drain_deadline is not None and c.clock() >= c.drain_deadline:
            self.hand_back(attempts)
            return
        for job_id, token in attempts.items():
            if c.io.heartbeat(job_id, token) is None:
                self.ended[token] = LEASE_LOST
                job_log("lease_lost", job=job_id, attempt=c.attempt_numbers.get(token))

    def _until_next_tick(self) -> float:
        """The renewal interval, cut short by a drain deadline that comes first."""
        c = self.coordinator
        if c.drain_deadline is None:
            return self.interval_seconds
        return max(0.0, min(self.interval_seconds, c.drain_deadline - c.clock()))

    def hand_back(self, attempts: dict[str, str]) -> None:
        """Ends ``attempts`` (job id -> token) as handed back, uncharged: the drain is over."""
        c = self.coordinator
        drained = Ending(outcome="failed", error="the worker group stopped before it finished",
                         code="worker_stopped", retryable=True, charged=False)
        for job_id, token in attempts.items():
            c.io.finish(job_id, token, drained)
            self.ended[token] = HANDED_BACK
            job_log("handed_back", job=job_id, attempt=c.attempt_numbers.get(token),
                    charged=False, why=f"drain of {c.config.drain_seconds:.0f} s over")


class Coordinator:
    """Rank 0's decisions for the group (a `runtime.rank_loop.GroupDriver`): plan, then update
    from what the ranks report. ``io``: its calls to the servers; ``clock``: monotonic
    seconds."""

    def __init__(self, config: WorkerConfig, layout: Layout, mode: str, platform_name: str, *,
                 io: GroupIO, group_id: str, lease_seconds: float,
                 gives_back_on_failure: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.layout = layout
        self.world = layout.world
        self.mode = mode
        self.goal = config.goal_for(layout)
        self.platform_name = platform_name
        self.io = io
        self.clock = clock
        self.group_id = group_id
        self.gives_back_on_failure = gives_back_on_failure
        self.host = socket.gethostname()
        # The jobs the replicas hold (running or suspended), by job id; a replica is named by
        # its first rank, as the plans name it (sp=1: every rank).
        self.held: dict[str, Holding] = {}
        self._claims_made = 0
        self.turns = TurnConfig()
        # Rendered jobs whose files their rank is still writing.
        self.writing: dict[str, Rendered] = {}
        self.cancels: dict[str, str] = {}  # job id -> reason, sent with the next plan
        self.hand_backs: set[str] = set()  # jobs handed back, checkpointed by the next plan
        self._await_write = False  # an interactive job rendered: its files come next turn
        self.stopping = False
        self.drain_deadline: float | None = None  # by the clock; set when a stop is asked for
        # Final transitions an outage held back, tried every turn.
        self.unfinished: dict[str, Ended] = {}
        self.attempt_numbers: dict[str, int] = {}  # attempt token -> its number, for the log
        self._beats: dict[str, float] = {}  # job id -> when its last heartbeat went out
        self.degraded: str | None = None  # why, while a server or the output store is out
        # While any rank's output store fails: why (no claims meanwhile; its finished jobs wait).
        self.store_error: str | None = None
        self.full_ranks: set[int] = set()  # ranks holding all the finished jobs they may
        # Each rank's latest report (in lock-step every rank reports every turn; at their own
        # pace the ranks report when they step, each on its own).
        self.rank_reports: dict[int, RankReport] = {}
        self.own_pace = False
        # On the CPU the replicas compute on one host's cores: at their own pace too, a batch
        # replica stepping beside an interactive job slows it (about 2.4x at dp=2 on two cores),
        # so it sits the interactive job's steps out (`StepPlan.pause`), as in lock-step. On an
        # accelerator each replica computes on its own device, and none waits for another.
        self.shares_cores = platform_name == "cpu"
        # At their own pace a replica of one rank leaves its step part-way for the job it is
        # given (`runtime.rank_loop._Interrupt`): the interactive job is claimed for it at once.
        # A replica of several ranks keeps to step boundaries, so it is preempted in two plans:
        # a hold first (it stops at its next step boundary), then, once its report says it waits
        # there (`waiting`), the claim of the interactive job for it. Replica -> when its hold
        # went out.
        self.replicas_interrupt = leaves_steps_part_way(layout)
        self.holds: dict[int, float] = {}
        self._backoff = 0.0  # seconds claims pause after the last outage error
        self._failed_claims = 0  # in a row, for the backoff
        self._claims_resume_at = 0.0  # by the clock
        self._last_report = -float("inf")
        self._last_work = clock()
        # The leavable step under way (lock-step): when it began, the jobs it computes, its
        # expected length (None: not known yet), and when the queue was last looked at.
        self._step_began = 0.0
        self._step_jobs: list[Holding] = []
        self._step_seconds: float | None = None
        self._step_keeps = False  # its jobs keep the blocks it computed if it is left
        self._looked = -float("inf")
        self.leases = LeaseKeeper(self, lease_seconds)

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        self.own_pace = own_pace
        self.report([memory], state="starting")
        self.leases.start()
        log.info("worker group %s: %d rank(s) (%s), model %s, %s, goal %s, replicas %s",
                 self.group_id, self.world, self.layout, self.config.model, self.mode, self.goal,
                 "at their own pace" if own_pace else "in lock-step")

    def stop(self, memory: dict[str, Any], *, failed: bool = False) -> None:
        """The loop is over. Normally the jobs still held go back to the queue. After a
        failure, when ``gives_back_on_failure`` (no launcher of ours ends the attempts: every
        rank was started by torchrun), they go back now, uncharged, as it is not known which
        rank failed, rather than charged by the reaper when their leases lapse; else the
        launcher ends them, charging the job of the rank that died
        (`kiln.worker.recover_attempts`)."""
        self.leases.stop()
        if not failed:
            self.give_back()
        elif self.gives_back_on_failure:
            self.give_back(Ending(outcome="failed", error="a rank of its worker group failed",
                                  code="group_failed", retryable=True, charged=False))
        self.report([memory], state="stopped")
        self.io.close()

    # Plan: the next turn's orders.
    def next_plan(self, stop_requested: bool) -> StepPlan:
        deadline = self.clock() + self.config.idle_tick_seconds
        while True:
            if stop_requested and not self.stopping:
                log.info("worker group %s: stopping; the running jobs have %.0f s to finish",
                         self.group_id, self.config.drain_seconds)
                self.stopping = True
                self.drain_deadline = self.clock() + self.config.drain_seconds
            if self.drain_deadline is not None and self.clock() >= self.drain_deadline:
                self._hand_back_running()
            for job_id, h in self.held.items():
                ended = self.leases.ended.get(h.ticket.attempt_token)
                if ended == HANDED_BACK:  # the drain is over: its ranks checkpoint it
                    self.hand_backs.add(job_id)
                elif ended is not None:  # its lease was lost
                    self.cancels.setdefault(job_id, ended)
            plan = StepPlan(drop=dict(self.cancels), hand_back=sorted(self.hand_backs))
            self.cancels.clear()
            self.hand_backs.clear()
            for job_id in (*plan.drop, *plan.hand_back):
                self.held.pop(job_id, None)
                self._beats.pop(job_id, None)
            # Finished jobs handed back (or whose lease was lost) while their files were still
            # being written: their ranks drop them.
            plan.abandon = [j for j, st in self.writing.items()
                            if st.attempt_token in self.leases.ended]
            for job_id in plan.abandon:
                self.writing.pop(job_id)
            if (not self.stopping and self.store_error is None
                    and self.clock() >= self._claims_resume_at):
                try:
                    self._claim_into(plan)
                except Exception as exc:
                    self._outage(exc, claims=True)
                else:
                    self._recovered()  # after the claims: these are not lost ones
            self._track()
            if self.held and self._await_write:
                # An interactive job has just rendered: a turn without a step, in which its
                # replica stores it (the turn ends as soon as it is stored), rather than a turn
                # of the batch job beside it before its final status can come.
                self._await_write = False
                self._last_work = self.clock()
                return plan
            if self.held:
                self._last_work = self.clock()
                self._choose_turn(plan)
                plan.step = True
                plan.leavable = self._leavable(plan)
                return plan
            if self.writing:  # a turn without a step, in which the ranks finish their writes
                self._last_work = self.clock()
                return plan
            idle_for = self.clock() - self._last_work
            exit_idle = self.config.exit_when_idle_seconds
            if self.stopping or (exit_idle is not None and idle_for > exit_idle):
                plan.stop = True
                return plan
            if plan.drop or plan.abandon or self.clock() >= deadline:
                return plan
            self.io.wait_for_work(self.config.poll_seconds)

    def _leavable(self, plan: StepPlan) -> bool:
        """Whether the group may leave this turn's step part-way (`StepPlan.leavable`): in
        lock-step, in a group that serves interactive work first, when the step computes only
        batch jobs that may still lose some of it (``LEAVE_BUDGET``). Notes the step for
        `leave_step`."""
        run = set((plan.run or {}).values())
        jobs = [h for job_id, h in self.held.items() if job_id in run]
        leavable = (not self.own_pace and GOAL_PREFERS[self.goal] == INTERACTIVE and bool(jobs)
                    and all(h.job_class != INTERACTIVE and h.lost_seconds < self._budget(h)
                            for h in jobs))
        self._step_jobs = jobs if leavable else []
        self._step_began = self.clock()
        known = [h.measured for h in jobs if h.measured]
        self._step_seconds = max(known) if known and len(known) == len(jobs) else None
        self._step_keeps = all(h.ticket.request.step_cache is None for h in jobs)
        return leavable

    @staticmethod
    def _budget(h: Holding) -> float:
        """The compute ``h`` may lose to steps left part-way, all told (``LEAVE_BUDGET``)."""
        per_step = h.measured or h.seconds_per_step
        return LEAVE_BUDGET * h.ticket.request.num_inference_steps * per_step

    def leave_step(self) -> bool:
        """Asked between two blocks of a leavable step: leave it when an interactive job is due
        and a replica can be given it at the next plan (a free one, or one whose batch job it
        would suspend), unless a job it computes has lost its budget or, for a step of a
        caching job, less of it is left than ``LEAVE_MIN_SECONDS`` or than it has run. Exact
        jobs keep the blocks the step computed and lose the one under way; a caching job loses
        what the step ran (the ranks report each job's loss, `Progress.lost_seconds`, which
        counts against its budget). The steps are taken again, bit for bit."""
        now = self.clock()
        if not self._step_jobs or now - self._looked < LEAVE_LOOK_SECONDS:
            return False
        self._looked = now
        elapsed = now - self._step_began
        ran = 0.0 if self._step_keeps else elapsed  # what leaving here loses, at most
        if (not self._step_keeps and self._step_seconds is not None
                and self._step_seconds - elapsed < max(LEAVE_MIN_SECONDS, ran)):
            return False
        if any(h.lost_seconds + ran >= self._budget(h) for h in self._step_jobs):
            return False
        if self.stopping or self.store_error is not None or now < self._claims_resume_at:
            return False
        held = {h.replica for h in self.held.values()}
        free = [r for r in self.layout.leaders if r not in held and r not in self.full_ranks]
        if not free and self._preempt_target() is None:
            return False
        try:
            due = self.io.interactive_due()
        except Exception:  # noqa: BLE001 - the next plan's claim reports the outage
            return False
        if due:
            for h in self._step_jobs:
                job_log("step_left", job=h.ticket.job_id, attempt=self.attempt_numbers.get(
                    h.ticket.attempt_token), replica=h.replica, step=h.steps_done,
                    after_s=round(elapsed, 3))
            self._step_jobs = []
        return due

    def tickets(self) -> list[Ticket]:
        """The tickets of every job the replicas hold, running or suspended."""
        return [h.ticket for h in self.held.values()]

    def replica_jobs(self, replica: int) -> list[Holding]:
        return [h for h in self.held.values() if h.replica == replica]

    def _track(self) -> None:
        self.leases.track(self.tickets(), self.writing, self.unfinished)

    def _choose_turn(self, plan: StepPlan) -> None:
        """Which replicas compute this turn, and which job each runs (`scheduler.turns`); a
        job suspended for another, or continued after one, is noted in its events."""
        now = self.clock()
        turn = choose_turn([h.held_job(now) for h in self.held.values()], self.turns,
                           shared=not self.own_pace or self.shares_cores)
        plan.run = turn.run
        if self.own_pace:
            plan.pause = sorted(turn.pause)
        running = set(turn.run.values())
        for job_id, h in self.held.items():
            if job_id in running:
                h.waiting_since = None
                if h.suspended_by is not None:
                    h.suspended_by = None
                    self._note("continued", h, step=h.steps_done)
                continue
            if h.waiting_since is None:
                h.waiting_since = now
            on_replica = turn.run.get(h.replica)
            if on_replica is not None and h.suspended_by is None:
                h.suspended_by = on_replica
                job_log("preempted", job=job_id, attempt=self.attempt_numbers.get(
                    h.ticket.attempt_token), replica=h.replica, by=on_replica)
                self._note("preempted", h, by_job=on_replica, step=h.steps_done)

    def _note(self, event: str, h: Holding, **fields: Any) -> None:
        """A job's event beside its render (preempted, continued, resumed): best effort."""
        try:
            self.io.note(event, h.ticket.job_id, h.ticket.attempt_token, **fields)
        except Exception as exc:
            self._outage(exc)

    def _hand_back_running(self) -> None:
        """The drain is over: the running jobs, and the finished ones whose files are not
        stored yet, go back to the queue, uncharged (their ranks checkpoint and drop them with
        the next plan)."""
        attempts = {t.job_id: t.attempt_token for t in self.tickets()
                    if t.attempt_token not in self.leases.ended}
        attempts.update((job_id, m.attempt_token) for job_id, m in self.writing.items()
                        if m.attempt_token not in self.leases.ended)
        if attempts:
            self.leases.hand_back(attempts)

    def _claim_into(self, plan: StepPlan) -> None:
        """Claims jobs for the free replicas into ``plan.assign``; with none free, in a group
        whose goal is latency (interactive jobs first), an interactive job that is due is
        claimed for the replica whose batch job has the most work left, which suspends that job
        in place (`scheduler.turns.preempt_target`). At their own pace a replica of several
        ranks is held first (`StepPlan.hold`), and the job claimed for it once it waits at its
        step boundary: a claim made in the middle of its step would wait for the rest of that
        step (a replica of one rank leaves the step for it). A throughput group serves batch
        work first: it does not preempt it."""
        held = {h.replica for h in self.held.values()}
        free = [r for r in self.layout.leaders if r not in held and r not in self.full_ranks]
        job_class = None
        if not free:
            if GOAL_PREFERS[self.goal] != INTERACTIVE:
                return
            target = self._preempt_target()
            if target is None or not self.io.interactive_due():
                return
            if self.own_pace and not self.replicas_interrupt and target not in self.waiting:
                if self.clock() - self.holds.get(target, -float("inf")) > HOLD_RETRY_SECONDS:
                    self.holds[target] = self.clock()
                    plan.hold.append(target)
                return
            self.holds.pop(target, None)
            free, job_class = [target], INTERACTIVE
        plan.assign = self._claim(free, job_class)

    @property
    def waiting(self) -> set[int]:
        """The replicas whose latest report says they wait at a step boundary on a hold (a
        replica given the job it waited for no longer qualifies as a target: it holds two)."""
        return {r for r, m in self.rank_reports.items() if m.waiting and self.layout.is_leader(r)}

    def _preempt_target(self) -> int | None:
        """The replica whose batch job an interactive job would suspend; at their own pace, one
        already waiting at its step boundary for it goes first while it still qualifies."""
        now = self.clock()
        held = [h.held_job(now) for h in self.held.values()]
        replicas = [r for r in self.layout.leaders if r not in self.full_ranks]
        waiting = [r for r in replicas if r in self.waiting] if self.own_pace else []
        for candidates in (waiting, replicas):
            target = preempt_target(held, candidates, max_jobs_per_replica=MAX_JOBS_PER_REPLICA,
                                    config=self.turns) if candidates else None
            if target is not None:
                return target
        return None

    def _claim(self, free: list[int], job_class: str | None = None) -> dict[int, Ticket]:
        # A replica offered to an interactive job holds the batch job it will suspend: to the
        # policy it is a free rank, and that job is not one of the group's running ones.
        running = [RunningJob(job_id=h.ticket.job_id, rank=h.replica, model=self.config.model,
                              cost_per_step=0.0, steps_left=h.steps_left)
                   for h in self.held.values() if h.replica not in free]
        claims = self.io.claim(free, running, job_class=job_class,
                               prefer=INTERACTIVE if job_class else GOAL_PREFERS[self.goal])
        costs: CostModel | None = None
        for c in claims:
            costs = costs or self.io.costs()
            self._hold(c, costs)
        return {c.replica: c.ticket for c in claims}

    def _hold(self, c: Claimed, costs: CostModel) -> None:
        self._claims_made += 1
        request = c.ticket.request
        self.held[c.ticket.job_id] = Holding(
            ticket=c.ticket, replica=c.replica, job_class=c.job_class,
            seconds_per_step=costs.step_seconds(c.model, c.tokens),
            steps_left=request.num_inference_steps, order=self._claims_made)
        self.attempt_numbers[c.ticket.attempt_token] = c.attempt
        job_log("claimed", job=c.ticket.job_id, attempt=c.attempt, replica=c.replica,
                group=self.group_id, job_class=c.job_class)

    # Update: what the ranks reported for the turn.
    def record(self, messages: list[RankMessage]) -> None:
        # Final transitions an outage held back go first: they land, or their lease is gone.
        for ended in list(self.unfinished.values()):
            self._finish(ended)
        for m in messages:
            if isinstance(m, RankReport):
                continue
            h = self.held.get(m.job_id)
            if h is not None and h.ticket.attempt_token != m.attempt_token:
                h = None  # a message of another attempt
            if isinstance(m, Progress):
                if h is not None:
                    self._progress(h, m)
                waited = self.clock() - self._beats.get(m.job_id, -float("inf"))
                if m.computed or waited >= PAUSED_BEAT_SECONDS:
                    self._heartbeat(m)
                continue
            if h is not None:
                self.held.pop(m.job_id)  # its replica is free of it
                self._beats.pop(m.job_id, None)
            if isinstance(m, Rendered):
                self.writing[m.job_id] = m
                self._await_write |= h is not None and h.job_class == INTERACTIVE
                continue
            self.writing.pop(m.job_id, None)
            self._finish(m)
        self.rank_reports.update((m.rank, m) for m in messages
                                 if isinstance(m, RankReport) and m.memory)
        self._note_writers(list(self.rank_reports.values()))
        self._track()
        now = self.clock()
        if now - self._last_report >= self.config.report_seconds:
            self.report([dict(m.memory) for m in self.rank_reports.values()])
            self._last_report = now

    def _heartbeat(self, st: Progress) -> None:
        """A running job's step, recorded; its lease renewed; a cancel request or a lost lease
        noted for the next plan."""
        self._beats[st.job_id] = self.clock()
        try:
            beat = self.io.heartbeat(st.job_id, st.attempt_token, step=st.step,
                                     num_inference_steps=st.num_inference_steps)
        except Exception as exc:
            # Progress waits for the server; the lease thread keeps the lease.
            self._outage(exc)
            return
        if beat is None:
            self.cancels[st.job_id] = LEASE_LOST
        elif beat.cancel_requested:
            self.cancels[st.job_id] = "cancelled by the user"
        else:
            self.io.progress(st.job_id, self.attempt_numbers.get(st.attempt_token), st.step,
                             st.num_inference_steps)

    def _progress(self, h: Holding, st: Progress) -> None:
        """A held job's report: steps left, its own seconds per step once it has run one, and
        where it resumed from (noted once per attempt)."""
        h.steps_left = st.num_inference_steps - st.step
        h.lost_seconds = st.lost_seconds
        done_here = st.step - (st.resumed_from_step or 0)
        if done_here > 0 and st.compute_seconds > 0:
            h.measured = st.compute_seconds / done_here
        if st.resumed_from_step is not None and not h.resume_noted:
            h.resume_noted = True
            job_log("resumed", job=h.ticket.job_id, attempt=self.attempt_numbers.get(
                h.ticket.attempt_token), replica=h.replica, step=st.resumed_from_step)
            self._note("resumed", h, step=st.resumed_from_step)

    def _note_writers(self, ranks: list[RankReport]) -> None:
        """What the ranks say of their writes. A rank holding all the finished jobs it may is
        given no new job. While any rank's output store fails, the group claims nothing (the
        finished jobs wait for the store, their leases kept, and are not rendered again) and
        reports itself degraded; claims resume once every rank's writes go through."""
        if not ranks:
            return
        self.full_ranks = {st.rank for st in ranks if not st.takes_jobs}
        failing = [st for st in ranks if st.store_error is not None]
        reason = (f"the output store is failing (rank {failing[0].rank}: "
                  f"{failing[0].store_error})" if failing else None)
        if (reason is None) != (self.store_error is None):
            if reason is not None:
                log.warning("worker group %s: %s; claims pause, finished jobs wait for it",
                            self.group_id, reason)
            else:
                log.info("worker group %s: the output store takes files again; claims resume",
                         self.group_id)
            self._last_report = -float("inf")  # say so now
        # While it fails, the store's reason is the one that holds the group back.
        if reason is not None or self.degraded == self.store_error:
            self.degraded = reason
        self.store_error = reason

    def _finish(self, st: Ended) -> None:
        """The attempt's final transition; one an outage stops is kept in ``unfinished`` and
        tried again every turn (the lease thread keeps its lease meanwhile)."""
        ending = Ending(outcome=st.outcome,  # type: ignore[arg-type]  # one of Ending's three
                        video_key=st.video_key,
                        thumbnail_key=st.thumbnail_key, has_audio=st.has_audio, error=st.error,
                        retryable=st.retryable, gathers=st.gathers,
                        blocks_computed=st.blocks_computed)
        try:
            state = self.io.finish(st.job_id, st.attempt_token, ending)
        except Exception as exc:
            self._outage(exc)
            self.unfinished[st.job_id] = st
            return
        self.unfinished.pop(st.job_id, None)
        self.io.forget(st.job_id)
        attempt = self.attempt_numbers.pop(st.attempt_token, None)
        job_log("ended", job=st.job_id, attempt=attempt, replica=st.rank,
                outcome=st.outcome, state=state or "not current", error=st.error)
        if state == JobState.SUCCEEDED:
            # The batcher learns the job's real cost: its rank's own step time, not the wall
            # time of its turns, which includes the turns it sat out.
            self.io.learn_cost(st.job_id, st.num_inference_steps, st.compute_seconds)

    def report(self, ranks: list[dict[str, Any]], state: str = "ready") -> None:
        ranks = sorted(ranks, key=lambda r: r["rank"])
        for r in ranks:
            jobs = sorted(self.replica_jobs(self.layout.leader(r["rank"])),
                          key=lambda h: h.waiting_since is not None)
            r["job_id"] = jobs[0].ticket.job_id if jobs else None
            r["suspended_jobs"] = [h.ticket.job_id for h in jobs[1:]]
            r["replica"] = self.layout.replica(r["rank"])
            # What the blocks are kept and moved in: the group's setting, the same on every rank.
            r["weights_dtype"] = self.config.weights_dtype
        reason = None
        if state == "ready" and self.degraded is not None:
            state, reason = "degraded", self.degraded
        report = GroupReport(id=self.group_id, name=self.config.name or self.group_id,
                             host=self.host, model=self.config.model,
                             mode="allgather" if self.mode == "allgather" else "rank_local",
                             platform=self.platform_name, dp_size=self.layout.dp,
                             world_size=self.world, goal=self.goal, plan=self.config.plan,
                             state=state, reason=reason, ranks=ranks)
        try:
            self.io.report(report)
        except Exception as exc:  # the next report says it again
            self._outage(exc)

    def give_back(self, stopped: Ending | None = None) -> None:
        """On the way out: jobs still running go back to the queue (the worker stopped)."""
        stopped = stopped or Ending(outcome="failed", error="the worker group stopped",
                                    code="worker_stopped", retryable=True, charged=False)
        attempts = [(t.job_id, t.attempt_token) for t in self.tickets()]
        attempts += [(job_id, m.attempt_token) for job_id, m in self.writing.items()]
        # Final transitions still held back by an outage: a last try each.
        for st in list(self.unfinished.values()):
            self._finish(st)
        deadline = time.monotonic() + GIVE_BACK_SECONDS  # a real wait: the servers may be out
        for job_id, token in attempts:
            while True:
                try:
                    self.io.finish(job_id, token, stopped)
                    break
                except Exception as exc:
                    self._outage(exc)
                    if time.monotonic() > deadline:  # the reaper takes it when it lapses
                        break
                    time.sleep(0.5)
        self.held.clear()
        self.writing.clear()

    # Outages.
    def _outage(self, exc: Exception, *, claims: bool = False) -> None:
        """A server is out: note it (the group reports itself degraded) and go on; a failed
        claim (``claims``) also pauses the next ones, with a backoff. Anything that is not an
        outage is raised."""
        if not is_outage(exc):
            raise exc
        reason = describe(exc)
        if self.degraded is None:
            log.warning("worker group %s: %s; claims pause, the jobs in hand go on",
                        self.group_id, reason)
        self.degraded = reason
        if claims:
            # Only the claims' own failures set the pause: the writes that fail meanwhile
            # (reports, heartbeats) must not hold the queue once the server is back.
            self._failed_claims += 1
            self._backoff = retry.backoff(self._failed_claims, first=0.5, cap=MAX_BACKOFF_SECONDS)
            self._claims_resume_at = self.clock() + self._backoff

    def _recovered(self) -> None:
        if self.degraded is not None:
            log.info("worker group %s: the servers answer again; claims resume", self.group_id)
            self.degraded = None
            self._last_report = -float("inf")  # say so now
            self._hand_back_lost_claims()
        self._backoff = 0.0
        self._failed_claims = 0

    def _hand_back_lost_claims(self) -> None:
        """Claims the database committed while the outage kept their answer from this group
        (the connection dropped after the COMMIT): rows running under this group's id that no
        rank renders. They go back to the queue uncharged, now rather than when their leases
        lapse."""
        held = {t.attempt_token for t in self.tickets()}
        held |= {m.attempt_token for m in self.writing.values()}
        held |= {st.attempt_token for st in self.unfinished.values()}
        lost = Ending(outcome="failed", error="its claim's answer was lost in an outage",
                      code="claim_lost", retryable=True, charged=False)
        try:
            for a in self.io.attempts():
                if a.token in held:
                    continue
                self.io.finish(a.job_id, a.token, lost)
                job_log("handed_back", job=a.job_id, attempt=a.attempt, replica=a.rank,
                        charged=False, why="its claim's answer was lost in an outage")
        except Exception as exc:
            self._outage(exc)
