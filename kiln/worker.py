"""The worker group's service loop: N ranks load the model once, then render queued jobs forever.

The ranks run `runtime.rank_loop` (one denoising step per turn, in lock-step). Rank 0 also runs
the `Coordinator`, this module's bookkeeping against the database, Redis and the batcher, as
vLLM's engine core is to its GPU workers: it turns what it knows into a `StepPlan` every turn
(jobs claimed for free ranks with `scheduler.claim.claim_for_group`, cancels, stop), and writes
down what the ranks report (progress and lease renewal, a heartbeat per step that also reports
cancel requests; each attempt's end through `scheduler.attempts.finish_attempt`). A rank is given
a new job at the first step boundary after its last one ended, while the other ranks carry on:
there are no waves.

Its side effects reach it from outside: the webhook enqueue (``notify``), the group report
(``report``) and the output store (the ranks' ``write``).

Launch: ``kiln worker --dp N`` spawns N local ranks (`runtime.launch`); under ``torchrun`` each
process is one rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``
from the launcher).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from redis import Redis, RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from common.families import family_of
from common.settings import Settings
from runtime.budget import AUTO, DeviceBudget
from runtime.launch import (
    RankContext,
    RankFailure,
    StopTimeout,
    device_for,
    run_ranks,
    run_this_rank,
    under_torchrun,
)
from runtime.pipelines.base import VideoRequest
from runtime.planner import JobShape, choose, heads_of, load_or_measure, plan, summary
from runtime.platform import get_platform
from runtime.rank_loop import RankLoop, RankStatus, StepPlan, Ticket, run_loop
from runtime.render import load_pipeline
from runtime.resume import model_fingerprint
from runtime.sequence import SOLO, Layout, open_sequence
from scheduler import queue_index
from scheduler.attempts import Ending, finish_attempt
from scheduler.claim import claim_for_group, job_tokens, load_costs, record_result
from scheduler.cost import CostModel
from scheduler.policy import DEFAULT_GOAL, GOAL_PREFERS, INTERACTIVE, RunningJob
from scheduler.turns import HeldJob, TurnConfig, choose_turn, preempt_target
from storage import lifecycle, queries, workers
from storage.db import make_engine, make_session_factory
from storage.outages import describe, is_outage
from storage.outputs import OutputStore, checkpoint_key, make_store
from storage.tables import Job, JobState
from storage.video import OutputWriter
from storage.webhooks import LIVE_EVENTS
from storage.workers import GroupReport, report_group

log = logging.getLogger(__name__)

def job_log(event: str, *, job: str, attempt: int | None = None, rank: int | None = None,
            **fields: object) -> None:
    """One line per job event, ``key=value`` after the event's name, so that one job's life can
    be followed with grep: ``event=claimed job=... attempt=1 rank=0 group=...``."""
    parts = [f"event={event}", f"job={job}", f"attempt={attempt}", f"rank={rank}"]
    parts += [f"{k}={v if isinstance(v, int | float) or v is None else repr(str(v))}"
              for k, v in fields.items()]
    log.info(" ".join(parts))


# While a server is out, claims pause for a backoff that doubles up to this.
MAX_BACKOFF_SECONDS = 10.0
# A job that asked for job.progress gets one at most this often (kept in memory on rank 0).
PROGRESS_EVERY_SECONDS = 2.0
# On the way out, how long the group keeps trying to hand its jobs back through an outage.
GIVE_BACK_SECONDS = 5.0
MAX_RESTART_BACKOFF_SECONDS = 30.0
# Why a job leaves its rank when the drain is over: its ranks checkpoint it on the way out.
HANDED_BACK = "handed back: the worker group stopped"
# Jobs a replica may hold at once: the one it runs and one it suspended for an interactive job.
MAX_JOBS_PER_REPLICA = 2
# After the drain deadline, how long the ranks have to leave before the launcher kills them:
# enough for the step in progress on a CPU, the hand-back, and the group's last report.
STOP_GRACE_SECONDS = 10.0


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    dp: int = 1  # replicas, each rendering its own job
    sp: int = 1  # ranks per replica, splitting its job's token sequence
    # "latency": interactive jobs first; "throughput": batch jobs first (either takes the other
    # class when its own is not queued). None: latency.
    goal: str | None = None
    # Device memory for resident blocks: "auto", None (stream all) or bytes (runtime.budget).
    device_budget: DeviceBudget = AUTO
    # --layout auto: plan dp, sp and the mode for this many ranks (`plan_layout`); the plan it
    # chose (the layout and the runner-up, predicted) is reported to /v1/workers.
    auto_world: int | None = None
    plan: dict[str, Any] | None = None
    model: str = "kiln-tiny"
    device: str = "cpu"  # cpu | cuda | npu
    use_allgather: bool = True
    poll_seconds: float = 0.05  # longest an idle coordinator waits for a wake before it looks
    idle_tick_seconds: float = 1.0  # longest an idle rank waits in a collective
    report_seconds: float = 2.0  # how often the group reports itself (memory, current jobs)
    exit_when_idle_seconds: float | None = None  # stop after this long without work (tests)
    # After a stop is asked for (SIGINT, SIGTERM), the running jobs have this long to finish;
    # then they are handed back, uncharged, and the ranks leave. docker-compose.yml gives the
    # worker a stop grace period above it.
    drain_seconds: float = 45.0
    # Every collective on the ranks returns or raises within this: a hung rank makes its peers
    # raise, and the group is started again. Above the longest step the admission rules let in.
    collective_timeout_seconds: float = 600.0
    max_restarts: int = 5  # rank set restarts allowed within restart_window_seconds
    restart_window_seconds: float = 600.0
    group_id: str = ""  # given by the launcher to each rank set it starts; new one if empty
    name: str = ""

    def __post_init__(self) -> None:
        if self.goal is not None and self.goal not in GOAL_PREFERS:
            raise ValueError(f"goal must be one of {sorted(GOAL_PREFERS)}, got {self.goal!r}")

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, sp=self.sp)

    def goal_for(self, layout: Layout) -> str:
        """The goal the group serves by: the declared one, else interactive jobs first."""
        return self.goal or DEFAULT_GOAL


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
    waiting_since: float | None = None  # monotonic, while it does not compute
    suspended_by: str | None = None  # the job it is suspended for (its replica runs that one)
    resume_noted: bool = False

    def held_job(self, now: float) -> HeldJob:
        waited = 0.0 if self.waiting_since is None else now - self.waiting_since
        return HeldJob(job_id=self.ticket.job_id, replica=self.replica,
                       job_class=self.job_class, seconds_per_step=self.seconds_per_step,
                       steps_left=self.steps_left, order=self.order, paused_seconds=waited,
                       measured=self.measured)


class LeaseKeeper:
    """Rank 0's thread that keeps the group's leases: the leases follow the group, not the step.

    Every ``lease_seconds / 4`` it renews the lease of every attempt the group holds (running or
    writing its files), so a step longer than the lease costs nothing; a lease lapses only when
    the group is gone. An attempt found no longer current (the reaper took it, a user deleted it)
    lands in ``ended`` for the coordinator to drop at the next step boundary. Once a stop's drain
    deadline passes it hands every attempt back, uncharged, from this thread: a step that runs
    past the deadline does not hold the job.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.interval_seconds = max(0.5, coordinator.settings.lease_seconds / 4)
        # job id -> attempt token; replaced whole by the loop's thread, read by this one.
        self._attempts: dict[str, str] = {}
        # attempt token -> why that attempt ended outside the loop (by token: the same job may
        # come back to this group in a later attempt)
        self.ended: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-leases", daemon=True)

    def track(self, running: Iterable[Ticket], *held: dict[str, RankStatus]) -> None:
        """The attempts to keep: ``running`` (running or suspended on a replica), and those
        whose files are being written or whose final transition waits (``held``: job id ->
        status)."""
        attempts = {t.job_id: t.attempt_token for t in running}
        for statuses in held:
            attempts.update((job_id, st.attempt_token) for job_id, st in statuses.items()
                            if st.attempt_token is not None)
        self._attempts = attempts

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        c = self.coordinator
        while not self._stop.wait(self._until_next_tick()):
            attempts = {j: t for j, t in self._attempts.items() if t not in self.ended}
            if not attempts:
                continue
            try:
                with c.sessions() as session:
                    if c.drain_deadline is not None and time.monotonic() >= c.drain_deadline:
                        self.hand_back(session, attempts)
                    else:
                        self._renew(session, attempts)
            except Exception:  # the database may be down: the next tick tries again
                log.warning("worker group %s: could not renew leases", c.group_id, exc_info=True)

    def _until_next_tick(self) -> float:
        """The renewal interval, cut short by a drain deadline that comes first."""
        deadline = self.coordinator.drain_deadline
        if deadline is None:
            return self.interval_seconds
        return max(0.0, min(self.interval_seconds, deadline - time.monotonic()))

    def _renew(self, session: Session, attempts: dict[str, str]) -> None:
        lease = self.coordinator.settings.lease_seconds
        for job_id, token in attempts.items():
            if lifecycle.heartbeat(session, job_id, token, lease_seconds=lease) is None:
                self.ended[token] = "the lease of this attempt was lost"
                job_log("lease_lost", job=job_id,
                        attempt=self.coordinator.attempt_numbers.get(token))

    def hand_back(self, session: Session, attempts: dict[str, str]) -> None:
        """Ends ``attempts`` (job id -> token) as handed back, uncharged: the drain is over."""
        c = self.coordinator
        drained = Ending(outcome="failed", error="the worker group stopped before it finished",
                         code="worker_stopped", retryable=True, charged=False)
        for job_id, token in attempts.items():
            finish_attempt(session, c.redis, c.settings.redis_prefix, job_id, token, drained,
                           notify=c.notify)
            self.ended[token] = HANDED_BACK
            job_log("handed_back", job=job_id, attempt=c.attempt_numbers.get(token),
                    charged=False, why=f"drain of {c.config.drain_seconds:.0f} s over")


class Coordinator:
    """Rank 0's bookkeeping against the database and Redis (a `runtime.rank_loop.GroupDriver`).

    ``notify(session, job_id)``: called after a job's final state is committed (default: the
    webhook enqueue, `kiln.tasks.enqueue_job_finished`); ``report(session, report)``: records
    the group's state for ``/v1/workers``.
    """

    def __init__(self, settings: Settings, config: WorkerConfig, layout: Layout, mode: str,
                 platform_name: str, *,
                 notify: Callable[[Session, str], object] | None = None,
                 report: Callable[[Session, GroupReport], object] = report_group,
                 send_event: Callable[[str, str, str, bytes], object] | None = None) -> None:
        self.settings = settings
        self.config = config
        self.layout = layout
        self.world = layout.world
        self.mode = mode
        self.goal = config.goal_for(layout)
        self.platform_name = platform_name
        if notify is None:
            # Here, not at the top: Celery (20 MiB a process) loads on rank 0 only, the one
            # rank that enqueues webhooks.
            from kiln.tasks import enqueue_job_finished

            notify = enqueue_job_finished
        if send_event is None:
            from kiln.tasks import enqueue_event  # here: Celery loads on rank 0 only

            send_event = enqueue_event
        self.notify = notify
        # job.started / job.progress: ``send_event(url, msg_id, kind, body)``, for the running
        # jobs that asked for them (job id -> (webhook_url, events)), known from their claim.
        self.send_event = send_event
        self.live_hooks: dict[str, tuple[str, frozenset[str]]] = {}
        self._last_progress: dict[str, float] = {}  # job id -> monotonic time of its last one
        self._report = report
        self.sessions = make_session_factory(make_engine(settings.database_url))
        if not settings.redis_url:
            raise ValueError("the worker needs REDIS_URL (kiln up sets it for its children)")
        self.redis = Redis.from_url(settings.redis_url)
        host = socket.gethostname()
        self.group_id = config.group_id or new_group_id()
        self.host = host
        # The jobs the replicas hold (running or suspended), by job id; a replica is named by
        # its first rank, as the plans name it (sp=1: every rank).
        self.held: dict[str, Holding] = {}
        self._claims_made = 0
        self.turns = TurnConfig()
        # Rendered jobs whose files their rank is still writing: job id -> its "rendered" status.
        self.writing: dict[str, RankStatus] = {}
        self.cancels: dict[str, str] = {}  # job id -> reason, sent with the next plan
        self.hand_backs: set[str] = set()  # jobs handed back, checkpointed by the next plan
        self._await_write = False  # an interactive job rendered: its files come next turn
        self.stopping = False
        self.drain_deadline: float | None = None  # monotonic; set when a stop is asked for
        # Final transitions an outage held back: job id -> the rank's status, tried every turn.
        self.unfinished: dict[str, RankStatus] = {}
        self.attempt_numbers: dict[str, int] = {}  # attempt token -> its number, for the log
        self.degraded: str | None = None  # why, while a server or the output store is out
        # While any rank's output store fails: why (no claims meanwhile; its finished jobs wait).
        self.store_error: str | None = None
        self.full_ranks: set[int] = set()  # ranks holding all the finished jobs they may
        self._backoff = 0.0  # seconds claims pause after the last outage error
        self._claims_resume_at = 0.0  # monotonic
        self._last_report = 0.0
        self._last_work = time.monotonic()
        self.leases = LeaseKeeper(self)

    def start(self, memory: dict[str, Any]) -> None:
        self.report([memory], state="starting")
        self.leases.start()
        log.info("worker group %s: %d rank(s) (%s), model %s, %s, goal %s", self.group_id,
                 self.world, self.layout, self.config.model, self.mode, self.goal)

    def stop(self, memory: dict[str, Any], *, failed: bool = False) -> None:
        self.leases.stop()
        if not failed:
            self.give_back()
        elif under_torchrun():
            # No launcher of ours will end the attempts (torchrun starts every node's ranks):
            # they go back now, uncharged (which rank failed is not known here), rather than
            # being charged by the reaper when their leases lapse.
            self.give_back(Ending(outcome="failed", error="a rank of its worker group failed",
                                  code="group_failed", retryable=True, charged=False))
        # else the launcher ends the attempts, charging the job of the rank that died
        # (`recover_attempts`).
        self.report([memory], state="stopped")

    # The plan for the next step.
    def next_plan(self, stop_requested: bool) -> StepPlan:
        deadline = time.monotonic() + self.config.idle_tick_seconds
        while True:
            if stop_requested and not self.stopping:
                log.info("worker group %s: stopping; the running jobs have %.0f s to finish",
                         self.group_id, self.config.drain_seconds)
                self.stopping = True
                self.drain_deadline = time.monotonic() + self.config.drain_seconds
            if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
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
            # Finished jobs handed back (or whose lease was lost) while their files were still
            # being written: their ranks drop them.
            plan.abandon = [j for j, st in self.writing.items()
                            if st.attempt_token in self.leases.ended]
            for job_id in plan.abandon:
                self.writing.pop(job_id)
            if (not self.stopping and self.store_error is None
                    and time.monotonic() >= self._claims_resume_at):
                try:
                    self._claim_into(plan)
                except Exception as exc:
                    self._outage(None, exc, claims=True)
                else:
                    self._recovered()  # after the claims: these are not lost ones
            self.leases.track(self.tickets(), self.writing, self.unfinished)
            if self.held and self._await_write:
                # An interactive job has just rendered: a turn without a step, in which its
                # replica stores it (the turn ends as soon as it is stored), rather than a turn
                # of the batch job beside it before its final status can come.
                self._await_write = False
                self._last_work = time.monotonic()
                return plan
            if self.held:
                self._last_work = time.monotonic()
                self._choose_turn(plan)
                plan.step = True
                return plan
            if self.writing:  # a turn without a step, in which the ranks finish their writes
                self._last_work = time.monotonic()
                return plan
            idle_for = time.monotonic() - self._last_work
            exit_idle = self.config.exit_when_idle_seconds
            if self.stopping or (exit_idle is not None and idle_for > exit_idle):
                plan.stop = True
                return plan
            if plan.drop or plan.abandon or time.monotonic() >= deadline:
                return plan
            self._wait_for_work()

    def tickets(self) -> list[Ticket]:
        """The tickets of every job the replicas hold, running or suspended."""
        return [h.ticket for h in self.held.values()]

    def replica_jobs(self, replica: int) -> list[Holding]:
        return [h for h in self.held.values() if h.replica == replica]

    def _choose_turn(self, plan: StepPlan) -> None:
        """Which replicas compute this turn, and which job each runs (`scheduler.turns`); a
        job suspended for another, or continued after one, is noted in its events."""
        now = time.monotonic()
        turn = choose_turn([h.held_job(now) for h in self.held.values()], self.turns)
        plan.run = turn.run
        running = set(turn.run.values())
        for job_id, h in self.held.items():
            if job_id in running:
                h.waiting_since = None
                if h.suspended_by is not None:
                    h.suspended_by = None
                    self._note(lifecycle.note_continued, h, step=self._steps_done(h))
                continue
            if h.waiting_since is None:
                h.waiting_since = now
            on_replica = turn.run.get(h.replica)
            if on_replica is not None and h.suspended_by is None:
                h.suspended_by = on_replica
                job_log("preempted", job=job_id, attempt=self.attempt_numbers.get(
                    h.ticket.attempt_token), rank=h.replica, by=on_replica)
                self._note(lifecycle.note_preempted, h, by_job=on_replica,
                           step=self._steps_done(h))

    @staticmethod
    def _steps_done(h: Holding) -> int:
        return h.ticket.request.num_inference_steps - h.steps_left

    def _note(self, write: Callable[..., object], h: Holding, **kwargs: Any) -> None:
        """A job's event beside its render (preempted, continued, resumed): best effort."""
        try:
            with self.sessions() as session:
                write(session, h.ticket.job_id, h.ticket.attempt_token, **kwargs)
        except Exception as exc:
            self._outage(None, exc)

    def _hand_back_running(self) -> None:
        """The drain is over: the running jobs, and the finished ones whose files are not
        stored yet, go back to the queue, uncharged (their ranks checkpoint and drop them with
        the next plan)."""
        attempts = {t.job_id: t.attempt_token for t in self.tickets()
                    if t.attempt_token not in self.leases.ended}
        attempts.update((job_id, st.attempt_token) for job_id, st in self.writing.items()
                        if st.attempt_token is not None
                        and st.attempt_token not in self.leases.ended)
        if attempts:
            with self.sessions() as session:
                self.leases.hand_back(session, attempts)

    def _wait_for_work(self) -> None:
        """Up to ``poll_seconds``, cut short when a submission announces work in Redis."""
        try:
            queue_index.wait_for_work(self.redis, self.settings.redis_prefix,
                                      self.config.poll_seconds)
        except RedisError:
            time.sleep(self.config.poll_seconds)  # the claim that follows reports the outage

    def _claim_into(self, plan: StepPlan) -> None:
        """Claims jobs for the free replicas into ``plan.assign``; with none free, an
        interactive job that is due is claimed for the replica whose batch job has the most
        work left, which suspends that job in place (`scheduler.turns.preempt_target`)."""
        held = {h.replica for h in self.held.values()}
        free = [r for r in self.layout.leaders if r not in held and r not in self.full_ranks]
        job_class = None
        if not free:
            now = time.monotonic()
            target = preempt_target(
                [h.held_job(now) for h in self.held.values()],
                [r for r in self.layout.leaders if r not in self.full_ranks],
                max_jobs_per_replica=MAX_JOBS_PER_REPLICA, config=self.turns)
            if target is None or not queue_index.has_due(
                    self.redis, self.settings.redis_prefix, self.config.model, INTERACTIVE,
                    time.time()):
                return
            free, job_class = [target], INTERACTIVE
        plan.assign = self._claim(free, job_class)

    def _claim(self, free: list[int], job_class: str | None = None) -> dict[int, Ticket]:
        # A replica offered to an interactive job holds the batch job it will suspend: to the
        # policy it is a free rank, and that job is not one of the group's running ones.
        running = [RunningJob(job_id=h.ticket.job_id, rank=h.replica, model=self.config.model,
                              cost_per_step=0.0, steps_left=h.steps_left)
                   for h in self.held.values() if h.replica not in free]
        with self.sessions() as session:
            claims = claim_for_group(
                session, self.redis, prefix=self.settings.redis_prefix, group_id=self.group_id,
                model=self.config.model, free_ranks=free, running=running,
                lease_seconds=self.settings.lease_seconds, sp=self.layout.sp,
                prefer=INTERACTIVE if job_class else GOAL_PREFERS[self.goal],
                job_class=job_class)
        tickets = {}
        costs = None
        for rank, claim in claims:
            job = claim.job
            ticket = Ticket(job_id=job.id, attempt_token=claim.attempt_token,
                            request=VideoRequest.of(job))
            tickets[rank] = ticket
            if costs is None:
                costs = self._costs()
            self._claims_made += 1
            self.held[job.id] = Holding(
                ticket=ticket, replica=rank, job_class=job.class_,
                seconds_per_step=costs.step_seconds(job.model, job_tokens(job)),
                steps_left=job.num_inference_steps, order=self._claims_made)
            self.attempt_numbers[claim.attempt_token] = job.attempts
            job_log("claimed", job=job.id, attempt=job.attempts, rank=rank,
                    group=self.group_id, job_class=job.class_)
            self.note_started(job)
        return tickets

    def _costs(self) -> CostModel:
        """The learned costs of this group's layout; the default guess while Redis is out."""
        try:
            return load_costs(self.redis, self.settings.redis_prefix, self.layout.sp)
        except RedisError:
            return CostModel(sp=self.layout.sp)

    def note_started(self, job: Job) -> None:
        """After a claim's commit: remembers whether the job wants job.started / job.progress
        (read from the claimed row, no further query) and sends job.started."""
        events = frozenset(job.webhook_events or ()) & LIVE_EVENTS
        if job.webhook_url is None or not events:
            return
        from kiln.tasks import started_event  # here: Celery loads on rank 0 only

        self.live_hooks[job.id] = (job.webhook_url, events)
        if "job.started" in events:
            msg_id, body = started_event(job)
            self.send_event(job.webhook_url, msg_id, "job.started", body)

    def _note_progress(self, st: RankStatus) -> None:
        """job.progress for a job that asked for it, at most every PROGRESS_EVERY_SECONDS."""
        job_id = st.job_id or ""
        hook = self.live_hooks.get(job_id)
        if hook is None or "job.progress" not in hook[1]:
            return
        now = time.monotonic()
        last = self._last_progress.get(job_id)
        if last is not None and now - last < PROGRESS_EVERY_SECONDS:
            return
        from kiln.tasks import progress_event  # here: Celery loads on rank 0 only

        self._last_progress[job_id] = now
        attempt = self.attempt_numbers.get(st.attempt_token or "")
        msg_id, body = progress_event(job_id, attempt, st.step, st.num_inference_steps)
        self.send_event(hook[0], msg_id, "job.progress", body)

    # What happened in the step.
    def record(self, statuses: list[RankStatus]) -> None:
        lease = self.settings.lease_seconds
        with self.sessions() as session:
            # Final transitions an outage held back go first: they land, or their lease is gone.
            for st in list(self.unfinished.values()):
                self._finish(session, st)
            for st in statuses:
                if st.job_id is None or st.attempt_token is None:
                    continue
                if st.outcome is None:
                    h = self.held.get(st.job_id)
                    if h is not None and h.ticket.attempt_token == st.attempt_token:
                        self._progress(h, st)
                    try:
                        beat = lifecycle.heartbeat(session, st.job_id, st.attempt_token,
                                                   step=st.step,
                                                   num_inference_steps=st.num_inference_steps,
                                                   lease_seconds=lease)
                    except Exception as exc:
                        # Progress waits for the server; the lease thread keeps the lease.
                        self._outage(session, exc)
                        continue
                    if beat is None:
                        self.cancels[st.job_id] = "the lease of this attempt was lost"
                    elif beat.cancel_requested:
                        self.cancels[st.job_id] = "cancelled by the user"
                    else:
                        self._note_progress(st)
                    continue
                h = self.held.get(st.job_id)
                if h is not None and h.ticket.attempt_token == st.attempt_token:
                    self.held.pop(st.job_id)  # its replica is free of it
                if st.outcome == "rendered":
                    self.writing[st.job_id] = st
                    self._await_write |= h is not None and h.job_class == INTERACTIVE
                    continue
                self.writing.pop(st.job_id, None)
                self._finish(session, st)
        self._note_writers(statuses)
        self.leases.track(self.tickets(), self.writing, self.unfinished)
        now = time.monotonic()
        if now - self._last_report >= self.config.report_seconds:
            self.report([st.memory for st in statuses if st.memory])
            self._last_report = now

    def _progress(self, h: Holding, st: RankStatus) -> None:
        """A held job's report: steps left, its own seconds per step once it has run one, and
        where it resumed from (noted once per attempt)."""
        h.steps_left = st.num_inference_steps - st.step
        done_here = st.step - (st.resumed_from_step or 0)
        if done_here > 0 and st.compute_seconds > 0:
            h.measured = st.compute_seconds / done_here
        if st.resumed_from_step is not None and not h.resume_noted:
            h.resume_noted = True
            job_log("resumed", job=h.ticket.job_id, attempt=self.attempt_numbers.get(
                h.ticket.attempt_token), rank=h.replica, step=st.resumed_from_step)
            self._note(lifecycle.note_resumed, h, step=st.resumed_from_step)

    def _note_writers(self, statuses: list[RankStatus]) -> None:
        """What the ranks say of their writes. A rank holding all the finished jobs it may is
        given no new job. While any rank's output store fails, the group claims nothing (the
        finished jobs wait for the store, their leases kept, and are not rendered again) and
        reports itself degraded; claims resume once every rank's writes go through."""
        ranks = [st for st in statuses if st.job_id is None and st.memory]
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
            self._last_report = 0.0  # say so now
        # While it fails, the store's reason is the one that holds the group back.
        if reason is not None or self.degraded == self.store_error:
            self.degraded = reason
        self.store_error = reason

    def _finish(self, session: Session, st: RankStatus) -> None:
        """The attempt's final transition; one an outage stops is kept in ``unfinished`` and
        tried again every turn (the lease thread keeps its lease meanwhile)."""
        assert st.job_id is not None and st.attempt_token is not None
        # The webhook goes out after the commit rather than at the next sweep (best effort:
        # ``notify`` never raises).
        try:
            state = finish_attempt(
                session, self.redis, self.settings.redis_prefix, st.job_id, st.attempt_token,
                Ending(outcome=st.outcome, video_key=st.video_key,  # type: ignore[arg-type]
                       thumbnail_key=st.thumbnail_key, error=st.error, retryable=st.retryable),
                notify=self.notify)
        except Exception as exc:
            self._outage(session, exc)
            self.unfinished[st.job_id] = st
            return
        self.unfinished.pop(st.job_id, None)
        self.live_hooks.pop(st.job_id, None)
        self._last_progress.pop(st.job_id, None)
        attempt = self.attempt_numbers.pop(st.attempt_token, None)
        job_log("ended", job=st.job_id, attempt=attempt, rank=st.rank,
                outcome=st.outcome, state=state or "not current", error=st.error)
        if state == JobState.SUCCEEDED:
            self._learn_cost(session, st)

    def _learn_cost(self, session: Session, st: RankStatus) -> None:
        """Teach the batcher this job's real cost (its rank's own step time, not lock-step
        wall time, which includes waiting for slower ranks), at this group's layout: a step
        split over sp ranks costs otherwise than one on a single rank."""
        try:
            job = session.get(Job, st.job_id)
        except SQLAlchemyError as exc:  # best effort: the next jobs teach the cost as well
            session.rollback()
            log.warning("could not learn the cost of job %s: %s", st.job_id,
                        describe(exc) if is_outage(exc) else repr(exc))
            return
        if job is None:
            return
        try:
            record_result(self.redis, prefix=self.settings.redis_prefix, job_id=job.id,
                          model=job.model, num_tokens=job_tokens(job),
                          num_inference_steps=st.num_inference_steps,
                          render_seconds=st.compute_seconds, sp=self.layout.sp)
        except RedisError:
            log.warning("could not record the cost of job %s", job.id, exc_info=True)

    def report(self, ranks: list[dict[str, Any]], state: str = "ready") -> None:
        ranks = sorted(ranks, key=lambda r: r["rank"])
        for r in ranks:
            jobs = sorted(self.replica_jobs(self.layout.leader(r["rank"])),
                          key=lambda h: h.waiting_since is not None)
            r["job_id"] = jobs[0].ticket.job_id if jobs else None
            r["suspended_jobs"] = [h.ticket.job_id for h in jobs[1:]]
            r["replica"] = self.layout.replica(r["rank"])
        reason = None
        if state == "ready" and self.degraded is not None:
            state, reason = "degraded", self.degraded
        report = GroupReport(id=self.group_id, name=self.config.name or self.group_id,
                             host=self.host, model=self.config.model,
                             mode="allgather" if self.mode == "allgather" else "rank_local",
                             platform=self.platform_name, dp_size=self.layout.dp,
                             world_size=self.world, goal=self.goal, plan=self.config.plan,
                             state=state, reason=reason, ranks=ranks)
        with self.sessions() as session:
            try:
                self._report(session, report)
            except Exception as exc:  # the next report says it again
                self._outage(session, exc)

    def give_back(self, stopped: Ending | None = None) -> None:
        """On the way out: jobs still running go back to the queue (the worker stopped)."""
        stopped = stopped or Ending(outcome="failed", error="the worker group stopped",
                                    code="worker_stopped", retryable=True, charged=False)
        attempts = [(t.job_id, t.attempt_token) for t in self.tickets()]
        attempts += [(job_id, st.attempt_token) for job_id, st in self.writing.items()]
        deadline = time.monotonic() + GIVE_BACK_SECONDS
        with self.sessions() as session:
            # Final transitions still held back by an outage: a last try each.
            for st in list(self.unfinished.values()):
                self._finish(session, st)
            for job_id, token in attempts:
                while True:
                    try:
                        finish_attempt(session, self.redis, self.settings.redis_prefix, job_id,
                                       token or "", stopped, notify=self.notify)
                        break
                    except Exception as exc:
                        self._outage(session, exc)
                        if time.monotonic() > deadline:  # the reaper takes it when it lapses
                            break
                        time.sleep(0.5)
        self.held.clear()
        self.writing.clear()

    def _outage(self, session: Session | None, exc: Exception, *,
                claims: bool = False) -> None:
        """A server is out: note it (the group reports itself degraded) and go on; a failed
        claim (``claims``) also pauses the next ones, with a backoff. Anything that is not an
        outage is raised."""
        if not is_outage(exc):
            raise exc
        if session is not None:
            session.rollback()
        reason = describe(exc)
        if self.degraded is None:
            log.warning("worker group %s: %s; claims pause, the jobs in hand go on",
                        self.group_id, reason)
        self.degraded = reason
        if claims:
            # Only the claims' own failures set the pause: the writes that fail meanwhile
            # (reports, heartbeats) must not hold the queue once the server is back.
            self._backoff = min(MAX_BACKOFF_SECONDS, max(0.5, 2 * self._backoff))
            self._claims_resume_at = time.monotonic() + self._backoff

    def _recovered(self) -> None:
        if self.degraded is not None:
            log.info("worker group %s: the servers answer again; claims resume", self.group_id)
            self.degraded = None
            self._last_report = 0.0  # say so now
            self._hand_back_lost_claims()
        self._backoff = 0.0

    def _hand_back_lost_claims(self) -> None:
        """Claims the database committed while the outage kept their answer from this group
        (the connection dropped after the COMMIT): rows running under this group's id that no
        rank renders. They go back to the queue uncharged, now rather than when their leases
        lapse."""
        held = {t.attempt_token for t in self.tickets()}
        held |= {st.attempt_token for st in (*self.writing.values(), *self.unfinished.values())}
        lost = Ending(outcome="failed", error="its claim's answer was lost in an outage",
                      code="claim_lost", retryable=True, charged=False)
        try:
            with self.sessions() as session:
                rows = queries.running_jobs_by_group(session, [self.group_id])
                for job in rows.get(self.group_id, []):
                    if job.attempt_token is None or job.attempt_token in held:
                        continue
                    finish_attempt(session, self.redis, self.settings.redis_prefix, job.id,
                                   job.attempt_token, lost, notify=self.notify)
                    job_log("handed_back", job=job.id, attempt=job.attempts, rank=job.rank,
                            charged=False, why="its claim's answer was lost in an outage")
        except Exception as exc:
            self._outage(None, exc)


def store_writer(store: OutputStore) -> OutputWriter:
    """The ranks' ``write``: a finished job's MP4 and thumbnail, into ``store``; while the store
    fails it keeps the encoded files for the next try. It stores running jobs' previews too."""
    return OutputWriter(store)


class StoreCheckpoints:
    """The ranks' checkpoints of their jobs' denoising states (`runtime.rank_loop.Checkpoints`),
    one object per job in the output store, written atomically like every other object."""

    def __init__(self, store: OutputStore) -> None:
        self.store = store

    def load(self, job_id: str) -> bytes | None:
        key = checkpoint_key(job_id)
        if not self.store.exists(key):
            return None
        with self.store.open(key) as f:
            return f.read()

    def save(self, job_id: str, blob: bytes) -> None:
        self.store.put_bytes(checkpoint_key(job_id), blob)

    def delete(self, job_id: str) -> None:
        self.store.delete(checkpoint_key(job_id))


def serve_rank(ctx: RankContext, settings: Settings, config: WorkerConfig) -> None:
    """Everything one rank does, from loading the model to leaving the group."""
    platform = get_platform(device_for(config.device))
    if ctx.world % config.sp:
        raise ValueError(f"--sp {config.sp} does not divide the group's {ctx.world} ranks")
    # Under torchrun the world is given and dp follows from it.
    layout = Layout(dp=ctx.world // config.sp, sp=config.sp)
    pipe = load_pipeline(config.model, device=platform.device,
                         use_allgather=config.use_allgather,
                         sequence=open_sequence(layout, platform.backend),
                         device_budget=config.device_budget,
                         max_tokens=settings.max_job_tokens)
    store = make_store(settings)
    checkpoints = (settings.checkpoint_every_steps > 0 or settings.checkpoint_every_seconds > 0)
    loop = RankLoop(ctx.rank, pipe, store_writer(store), platform,
                    host_memory_every_seconds=config.report_seconds, layout=layout,
                    preview_every_steps=settings.preview_every_steps,
                    checkpoints=StoreCheckpoints(store) if checkpoints else None,
                    checkpoint_every_steps=settings.checkpoint_every_steps,
                    checkpoint_every_seconds=settings.checkpoint_every_seconds,
                    model_fingerprint=model_fingerprint(config.model))
    coordinator = None
    if ctx.rank == 0:
        mode = "allgather" if config.use_allgather and ctx.world > 1 else "rank_local"
        coordinator = Coordinator(settings, config, layout, mode, platform.name)
    run_loop(ctx.rank, ctx.world, loop, coordinator, ctx.stop)


def run_worker(settings: Settings, config: WorkerConfig,
               on_started: Callable[[], None] | None = None) -> int:
    """Start the group: under torchrun this process is one rank; else spawn ``config.dp`` ranks,
    and start them again when one dies.

    A rank that dies (or raises, or hangs a collective past ``collective_timeout_seconds``) takes
    its group down; the launcher then ends the group's attempts at once, charging only the job
    of the rank that died (`recover_attempts`), and starts a new rank set after a backoff (1 s,
    doubling to 30 s; the model reloads from the shared mmap). More than ``max_restarts``
    restarts within ``restart_window_seconds`` is a crash loop: it gives up.

    Returns an exit code: 0 after a graceful stop (SIGINT or SIGTERM: the running jobs have
    ``config.drain_seconds`` to finish, then go back to the queue uncharged; a second signal
    kills the ranks), 1 after a crash loop.
    """
    if config.auto_world is not None:
        if under_torchrun():
            raise ValueError("--layout auto plans on this machine before it starts the ranks; "
                             "under torchrun give --sp (plan first with kiln plan)")
        config = plan_layout(settings, config)
    layout = config.layout  # checks dp and sp
    if under_torchrun():
        run_this_rank(serve_rank, settings, config, device=config.device,
                      collective_timeout_s=config.collective_timeout_seconds)
        return 0
    restarts: list[float] = []
    backoff = 1.0
    while True:
        group = replace(config, group_id=config.group_id or new_group_id())
        started = time.monotonic()
        try:
            run_ranks(layout.world, serve_rank, settings, group, device=config.device,
                      on_started=on_started, timeout_s=None, graceful_stop=True,
                      stop_timeout_s=config.drain_seconds + STOP_GRACE_SECONDS,
                      collective_timeout_s=config.collective_timeout_seconds,
                      log_format="[rank {rank}] %(levelname)s %(message)s")
            return 0
        except StopTimeout as exc:
            # A step ran past the drain: its job was handed back at the deadline already.
            log.warning("worker group stopped: %s", exc)
            return 0
        except RankFailure as exc:
            log.error("worker group %s failed: %s", group.group_id, exc)
            charged = recover_attempts(settings, group.group_id, exc, layout)
            if exc.stopping:
                return 0
        now = time.monotonic()
        if now - started > config.restart_window_seconds:
            backoff = 1.0  # it ran well for a while: this is not a loop
        restarts = [t for t in restarts if now - t < config.restart_window_seconds]
        # A crash charged to the job its rank was rendering is that job's (its attempts bound
        # it); the others count towards the crash loop.
        if not charged:
            restarts.append(now)
        else:
            backoff = 1.0
        if len(restarts) > config.max_restarts:
            log.error("the ranks failed %d times within %.0f s; not starting them again",
                      len(restarts), config.restart_window_seconds)
            return 1
        log.warning("starting the ranks again in %.0f s", backoff)
        if _stop_requested_within(backoff):
            return 0
        backoff = min(MAX_RESTART_BACKOFF_SECONDS, 2 * backoff)


def plan_layout(settings: Settings, config: WorkerConfig) -> WorkerConfig:
    """``--layout auto``: the planner's layout of ``config.auto_world`` ranks for the group's
    goal, at the model's default job (`runtime.planner`; the profile is measured on two CPU
    ranks the first time, then cached under the data directory). Logs the choice and the
    runner-up."""
    if config.device != "cpu":
        raise ValueError("--layout auto plans from a profile measured on CPU ranks; on "
                         f"{config.device} give --dp and --sp")
    world = config.auto_world or 1
    goal = config.goal_for(config.layout)
    d = family_of(config.model).defaults
    job = JobShape(d.width, d.height, d.num_frames, d.num_inference_steps)
    profile, source = load_or_measure(config.model, settings.data_dir)
    result = plan(profile, world, job, tokens=job.tokens(config.model),
                  heads=heads_of(config.model))
    best, runner_up = choose(result, goal)
    reason = result.reasons["latency" if goal == "latency" else "throughput"]
    log.info("layout auto for %d rank(s), goal %s, job %s: %s (predicted %.3g s a job, %.0f "
             "jobs/h); runner-up %s (%.3g s, %.0f jobs/h). %s. Profile: %s", world, goal, job,
             best.layout, best.latency_seconds, best.jobs_per_hour, runner_up.layout,
             runner_up.latency_seconds, runner_up.jobs_per_hour, reason, source)
    return replace(config, dp=best.dp, sp=best.sp, use_allgather=best.mode == "allgather",
                   auto_world=None,
                   plan={"goal": goal, "world": world, "job": str(job), "profile": source,
                         "chosen": summary(best), "runner_up": summary(runner_up),
                         "reason": reason})


def new_group_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _stop_requested_within(seconds: float) -> bool:
    """Waits ``seconds``; True if SIGINT or SIGTERM came meanwhile."""
    asked = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: asked.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asked.wait(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Signals that end a process for what it was doing (a crash), and SIGKILL, which is what the
# kernel's out-of-memory killer sends: the job the rank was rendering may have caused it.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                  signal.SIGKILL}


# What a rank's traceback says when a collective failed under it (a peer died or hung): the
# rank is a victim, not the cause.
_LOST_PEER = ("DistBackendError", "Gloo", "NCCL", "HCCL", "Connection closed by peer",
              "Timed out")


def recover_attempts(settings: Settings, group_id: str, failure: RankFailure,
                     layout: Layout = SOLO) -> int:
    """Ends the attempts a failed group still holds, now rather than when their leases lapse.

    The job of a rank that crashed (died by a crash signal or SIGKILL, or exited with an error)
    is charged: it may have caused the crash; a job that crashes its rank every time ends
    ``dead`` after its attempts. The other ranks' jobs go back uncharged. With no rank to blame
    (a hang, or the ranks' own report of a lost peer), nothing is charged. A rank of a replica
    that crashed charges its replica's job (recorded under the replica's first rank). Returns
    how many attempts it charged.
    """
    crashed = {r for r in failure.ranks
               if (code := failure.exit_codes.get(r)) is not None
               and (code > 0 or -code in _CRASH_SIGNALS)}
    if not failure.exit_codes and not any(s in str(failure) for s in _LOST_PEER):
        crashed = set(failure.ranks)  # a rank raised outside a job's step: its job
    crashed = {layout.leader(r) for r in crashed}
    sessions = make_session_factory(make_engine(settings.database_url))
    redis = Redis.from_url(settings.redis_url) if settings.redis_url else None
    charged: set[str] = set()

    def end_attempts() -> None:
        with sessions() as session:
            held = queries.running_jobs_by_group(session, [group_id]).get(group_id, [])
            for job in held:
                if job.attempt_token is None:
                    continue
                if job.rank in crashed:
                    charged.add(job.id)
                    ending = Ending(outcome="failed", error=f"its rank ({job.rank}) crashed "
                                    "while rendering it", code="rank_crashed", retryable=True)
                else:
                    ending = Ending(outcome="failed", error="another rank of its worker group "
                                    "failed", code="group_failed", retryable=True,
                                    charged=False)
                state = finish_attempt(session, redis, settings.redis_prefix,  # type: ignore[arg-type]
                                       job.id, job.attempt_token, ending,
                                       notify=_enqueue_job_finished)
                job_log("recovered", job=job.id, attempt=job.attempts, rank=job.rank,
                        state=state, charged=ending.charged, error=ending.error)
            workers.mark_stopped(session, group_id, reason=str(failure).splitlines()[0][:500])

    # A server that is out is waited for (each try ends only the attempts still running, by
    # their tokens), until the leases would lapse anyway: then the reaper ends them, charged.
    give_up = time.monotonic() + settings.lease_seconds
    wait = 1.0
    try:
        while True:
            try:
                end_attempts()
                break
            except Exception as exc:
                if not is_outage(exc):
                    raise
                if time.monotonic() + wait > give_up:
                    log.warning("could not end the attempts of group %s: %s; their leases "
                                "lapse and the reaper ends them", group_id, describe(exc))
                    break
                log.warning("could not end the attempts of group %s yet: %s; trying again in "
                            "%.0f s", group_id, describe(exc), wait)
                time.sleep(wait)
                wait = min(2 * wait, 5.0)
    finally:
        if redis is not None:
            redis.close()
        sessions.kw["bind"].dispose()
    return len(charged)


def _enqueue_job_finished(session: Session, job_id: str) -> object:
    # Here, not at the top: Celery (20 MiB a process) loads only when a group failed.
    from kiln.tasks import enqueue_job_finished

    return enqueue_job_finished(session, job_id)
