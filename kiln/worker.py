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
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis, RedisError
from sqlalchemy.orm import Session

from common.settings import Settings
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
from runtime.platform import get_platform
from runtime.rank_loop import RankLoop, RankStatus, StepPlan, Ticket, run_loop
from runtime.render import load_pipeline
from scheduler import queue_index
from scheduler.attempts import Ending, finish_attempt
from scheduler.claim import claim_for_group, job_tokens, record_result
from scheduler.policy import RunningJob
from storage import lifecycle
from storage.db import make_engine, make_session_factory
from storage.outputs import OutputStore, make_store, thumbnail_key, video_key
from storage.tables import Job, JobState
from storage.video import write_outputs
from storage.workers import GroupReport, report_group

log = logging.getLogger(__name__)

# After the drain deadline, how long the ranks have to leave before the launcher kills them:
# enough for the step in progress on a CPU, the hand-back, and the group's last report.
STOP_GRACE_SECONDS = 10.0


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    dp: int = 1
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
    name: str = ""


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
        self.ended: dict[str, str] = {}  # job id -> why its attempt ended outside the loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-leases", daemon=True)

    def track(self, running: dict[int, Ticket], writing: dict[str, RankStatus]) -> None:
        attempts = {t.job_id: t.attempt_token for t in running.values()}
        attempts.update((job_id, st.attempt_token) for job_id, st in writing.items()
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
            attempts = {j: t for j, t in self._attempts.items() if j not in self.ended}
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
                self.ended[job_id] = "the lease of this attempt was lost"

    def hand_back(self, session: Session, attempts: dict[str, str]) -> None:
        """Ends ``attempts`` (job id -> token) as handed back, uncharged: the drain is over."""
        c = self.coordinator
        drained = Ending(outcome="failed", error="the worker group stopped before it finished",
                         code="worker_stopped", retryable=True, charged=False)
        for job_id, token in attempts.items():
            finish_attempt(session, c.redis, c.settings.redis_prefix, job_id, token, drained,
                           notify=c.notify)
            self.ended[job_id] = "handed back: the worker group stopped"
            log.info("job %s: handed back, uncharged (drain of %.0f s over)", job_id,
                     c.config.drain_seconds)


class Coordinator:
    """Rank 0's bookkeeping against the database and Redis (a `runtime.rank_loop.GroupDriver`).

    ``notify(session, job_id)``: called after a job's final state is committed (default: the
    webhook enqueue, `kiln.tasks.enqueue_job_finished`); ``report(session, report)``: records
    the group's state for ``/v1/workers``.
    """

    def __init__(self, settings: Settings, config: WorkerConfig, world: int, mode: str,
                 platform_name: str, *,
                 notify: Callable[[Session, str], object] | None = None,
                 report: Callable[[Session, GroupReport], object] = report_group) -> None:
        self.settings = settings
        self.config = config
        self.world = world
        self.mode = mode
        self.platform_name = platform_name
        if notify is None:
            # Here, not at the top: Celery (20 MiB a process) loads on rank 0 only, the one
            # rank that enqueues webhooks.
            from kiln.tasks import enqueue_job_finished

            notify = enqueue_job_finished
        self.notify = notify
        self._report = report
        self.sessions = make_session_factory(make_engine(settings.database_url))
        if not settings.redis_url:
            raise ValueError("the worker needs REDIS_URL (kiln up sets it for its children)")
        self.redis = Redis.from_url(settings.redis_url)
        host = socket.gethostname()
        self.group_id = f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
        self.host = host
        self.running: dict[int, Ticket] = {}  # rank -> job it renders
        # Rendered jobs whose files their rank is still writing: job id -> its "rendered" status.
        self.writing: dict[str, RankStatus] = {}
        self.steps_left: dict[int, int] = {}
        self.cancels: dict[int, str] = {}  # rank -> reason, sent with the next plan
        self.stopping = False
        self.drain_deadline: float | None = None  # monotonic; set when a stop is asked for
        self._last_report = 0.0
        self._last_work = time.monotonic()
        self.leases = LeaseKeeper(self)

    def start(self, memory: dict[str, Any]) -> None:
        self.report([memory], state="starting")
        self.leases.start()
        log.info("worker group %s: %d rank(s), model %s, %s", self.group_id, self.world,
                 self.config.model, self.mode)

    def stop(self, memory: dict[str, Any]) -> None:
        self.leases.stop()
        self.give_back()
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
            for rank, ticket in self.running.items():
                ended = self.leases.ended.get(ticket.job_id)
                if ended is not None:  # its lease was lost, or it was handed back at the deadline
                    self.cancels.setdefault(rank, ended)
            plan = StepPlan(drop=dict(self.cancels))
            self.cancels.clear()
            for rank in plan.drop:
                self.running.pop(rank, None)
            free = [r for r in range(self.world) if r not in self.running]
            if free and not self.stopping:
                plan.assign = self._claim(free)
                self.running.update(plan.assign)
            self.leases.track(self.running, self.writing)
            if self.running:
                self._last_work = time.monotonic()
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
            if plan.drop or time.monotonic() >= deadline:
                return plan
            self._wait_for_work()

    def _hand_back_running(self) -> None:
        """The drain is over: the running jobs go back to the queue, uncharged (their ranks drop
        them with the next plan)."""
        attempts = {t.job_id: t.attempt_token for t in self.running.values()
                    if t.job_id not in self.leases.ended}
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

    def _claim(self, free: list[int]) -> dict[int, Ticket]:
        running = [RunningJob(job_id=t.job_id, rank=r, model=self.config.model,
                              cost_per_step=0.0, steps_left=self.steps_left.get(r, 0))
                   for r, t in self.running.items()]
        with self.sessions() as session:
            claims = claim_for_group(
                session, self.redis, prefix=self.settings.redis_prefix, group_id=self.group_id,
                model=self.config.model, free_ranks=free, running=running,
                lease_seconds=self.settings.lease_seconds)
        tickets = {}
        for rank, claim in claims:
            job = claim.job
            tickets[rank] = Ticket(job_id=job.id, attempt_token=claim.attempt_token,
                                   request=VideoRequest.of(job))
            self.steps_left[rank] = job.num_inference_steps
        return tickets

    # What happened in the step.
    def record(self, statuses: list[RankStatus]) -> None:
        lease = self.settings.lease_seconds
        with self.sessions() as session:
            for st in statuses:
                if st.job_id is None or st.attempt_token is None:
                    continue
                if st.outcome is None:
                    self.steps_left[st.rank] = st.num_inference_steps - st.step
                    beat = lifecycle.heartbeat(session, st.job_id, st.attempt_token,
                                               step=st.step,
                                               num_inference_steps=st.num_inference_steps,
                                               lease_seconds=lease)
                    if beat is None:
                        self.cancels[st.rank] = "the lease of this attempt was lost"
                    elif beat.cancel_requested:
                        self.cancels[st.rank] = "cancelled by the user"
                    continue
                ticket = self.running.get(st.rank)
                if ticket is not None and ticket.job_id == st.job_id:
                    self.running.pop(st.rank)  # the rank is free (its next job may be running)
                if st.outcome == "rendered":
                    self.writing[st.job_id] = st
                    continue
                self.writing.pop(st.job_id, None)
                self._finish(session, st)
        self.leases.track(self.running, self.writing)
        now = time.monotonic()
        if now - self._last_report >= self.config.report_seconds:
            self.report([st.memory for st in statuses if st.memory])
            self._last_report = now

    def _finish(self, session: Session, st: RankStatus) -> None:
        assert st.job_id is not None and st.attempt_token is not None
        # The webhook goes out after the commit rather than at the next sweep (best effort:
        # ``notify`` never raises).
        state = finish_attempt(
            session, self.redis, self.settings.redis_prefix, st.job_id, st.attempt_token,
            Ending(outcome=st.outcome, video_key=st.video_key,  # type: ignore[arg-type]
                   thumbnail_key=st.thumbnail_key, error=st.error, retryable=st.retryable),
            notify=self.notify)
        if state == JobState.SUCCEEDED:
            self._learn_cost(session, st)
        elif state is None:
            log.info("job %s: dropped (%s)", st.job_id, st.error or st.outcome)

    def _learn_cost(self, session: Session, st: RankStatus) -> None:
        """Teach the batcher this job's real cost (its rank's own step time, not lock-step
        wall time, which includes waiting for slower ranks)."""
        job = session.get(Job, st.job_id)
        if job is None:
            return
        try:
            record_result(self.redis, prefix=self.settings.redis_prefix, job_id=job.id,
                          model=job.model, num_tokens=job_tokens(job),
                          num_steps=st.num_inference_steps,
                          render_seconds=st.compute_seconds)
        except RedisError:
            log.warning("could not record the cost of job %s", job.id, exc_info=True)

    def report(self, ranks: list[dict[str, Any]], state: str = "ready") -> None:
        ranks = sorted(ranks, key=lambda r: r["rank"])
        for r in ranks:
            ticket = self.running.get(r["rank"])
            r["job_id"] = ticket.job_id if ticket else None
        report = GroupReport(id=self.group_id, name=self.config.name or self.group_id,
                             host=self.host, model=self.config.model,
                             mode="allgather" if self.mode == "allgather" else "rank_local",
                             platform=self.platform_name, dp_size=self.world,
                             world_size=self.world, state=state, ranks=ranks)
        with self.sessions() as session:
            self._report(session, report)

    def give_back(self) -> None:
        """On the way out: jobs still running go back to the queue (the worker stopped)."""
        stopped = Ending(outcome="failed", error="the worker group stopped",
                         code="worker_stopped", retryable=True, charged=False)
        attempts = [(t.job_id, t.attempt_token) for t in self.running.values()]
        attempts += [(job_id, st.attempt_token) for job_id, st in self.writing.items()]
        with self.sessions() as session:
            for job_id, token in attempts:
                finish_attempt(session, self.redis, self.settings.redis_prefix, job_id,
                               token or "", stopped, notify=self.notify)
        self.running.clear()
        self.writing.clear()


def store_writer(store: OutputStore) -> Callable[[Any, str, int], tuple[str, str]]:
    """The ranks' ``write``: a finished job's MP4 and thumbnail, into ``store``."""

    def write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        with tempfile.TemporaryDirectory(prefix="kiln-out-") as tmp:
            video, thumb = write_outputs(frames, Path(tmp) / f"{job_id}.mp4", fps=fps)
            store.put(video_key(job_id), Path(video))
            store.put(thumbnail_key(job_id), Path(thumb))
        return video_key(job_id), thumbnail_key(job_id)

    return write


def serve_rank(ctx: RankContext, settings: Settings, config: WorkerConfig) -> None:
    """Everything one rank does, from loading the model to leaving the group."""
    platform = get_platform(device_for(config.device))
    pipe = load_pipeline(config.model, device=platform.device,
                         use_allgather=config.use_allgather)
    loop = RankLoop(ctx.rank, pipe, store_writer(make_store(settings)), platform,
                    host_memory_every_seconds=config.report_seconds)
    coordinator = None
    if ctx.rank == 0:
        mode = "allgather" if config.use_allgather and ctx.world > 1 else "rank_local"
        coordinator = Coordinator(settings, config, ctx.world, mode, platform.name)
    run_loop(ctx.rank, ctx.world, loop, coordinator, ctx.stop)


def run_worker(settings: Settings, config: WorkerConfig,
               on_started: Callable[[], None] | None = None) -> int:
    """Start the group: under torchrun this process is one rank; else spawn ``config.dp`` ranks.

    Returns an exit code: 0 after a graceful stop (SIGINT or SIGTERM: the running jobs have
    ``config.drain_seconds`` to finish, then go back to the queue uncharged; a second signal
    kills the ranks), 1 if a rank died.
    """
    if config.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {config.dp}")
    if under_torchrun():
        run_this_rank(serve_rank, settings, config, device=config.device)
        return 0
    try:
        run_ranks(config.dp, serve_rank, settings, config, device=config.device,
                  on_started=on_started, timeout_s=None, graceful_stop=True,
                  stop_timeout_s=config.drain_seconds + STOP_GRACE_SECONDS,
                  log_format="[rank {rank}] %(levelname)s %(message)s")
    except StopTimeout as exc:
        # A step ran past the drain: its job was handed back at the deadline already.
        log.warning("worker group stopped: %s", exc)
        return 0
    except RankFailure as exc:
        log.error("worker group stopped: %s", exc)
        return 1
    return 0
