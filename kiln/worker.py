"""The worker group's service: N ranks load the model once, then render queued jobs forever.

The ranks run `runtime.rank_loop` turn by turn; rank 0 also runs the group's
`kiln.coordinator.Coordinator` (what each replica does next), whose calls to the database,
Redis and the webhook queue go through `kiln.group_io.ServerIO`. The ranks store their jobs'
files and checkpoints in the output store themselves (`store_writer`, `StoreCheckpoints`).

This module starts the ranks (`serve_rank`), restarts a group that failed after ending the
attempts it held (`run_worker`, `recover_attempts`), and plans ``--layout auto``
(`plan_layout`).

Launch: ``kiln worker --dp N`` spawns N local ranks (`runtime.launch`); under ``torchrun`` each
process is one rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``
from the launcher).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from redis import Redis
from sqlalchemy.orm import Session

from common import logs, retry
from common.families import checkpoint_family, family_of
from common.settings import Settings
from kiln.config import WorkerConfig
from kiln.coordinator import Coordinator, job_log, new_group_id
from kiln.group_io import ServerIO
from runtime.adapter_cache import AdapterCache
from runtime.adapters import LOADERS
from runtime.launch import (
    RankContext,
    RankFailure,
    StopTimeout,
    device_for,
    run_ranks,
    run_this_rank,
    under_torchrun,
)
from runtime.planner import JobShape, choose, heads_of, load_or_measure, plan, summary
from runtime.platform import get_platform
from runtime.rank_loop import RankLoop, run_loop
from runtime.render import load_pipeline
from runtime.resume import model_fingerprint
from runtime.sequence import SOLO, Layout, open_sequence
from scheduler.attempts import Ending, finish_attempt
from storage import queries, workers
from storage.db import make_engine, make_session_factory
from storage.outages import describe, is_outage
from storage.outputs import OutputStore, checkpoint_key, make_store
from storage.video import OutputWriter

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

MAX_RESTART_BACKOFF_SECONDS = 30.0
# After the drain deadline, how long the ranks have to leave before the launcher kills them:
# enough for the step in progress on a CPU, the hand-back, and the group's last report.
STOP_GRACE_SECONDS = 10.0


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


def adapter_budget(settings: Settings, model: str) -> int:
    """Each rank's adapter cache budget, for a model that takes adapters (else none)."""
    return settings.adapter_cache_bytes if checkpoint_family(model).name in LOADERS else 0


def _read(store: OutputStore, key: str) -> bytes:
    with store.open(key) as f:
        return f.read()


def serve_rank(ctx: RankContext, settings: Settings, config: WorkerConfig) -> None:
    """Everything one rank does, from loading the model to leaving the group."""
    # A rank is a process of its own (spawned, or torchrun's) that inherits no logging: every
    # line of it carries its rank.
    logs.configure(settings.log_level, settings.log_format, process="worker", rank=ctx.rank)
    platform = get_platform(device_for(config.device))
    if ctx.world % config.sp:
        raise ValueError(f"--sp {config.sp} does not divide the group's {ctx.world} ranks")
    # Under torchrun the world is given and dp follows from it.
    layout = Layout(dp=ctx.world // config.sp, sp=config.sp)
    pipe = load_pipeline(config.model, device=platform.device,
                         use_allgather=config.use_allgather,
                         sequence=open_sequence(layout, platform.backend),
                         device_budget=config.device_budget,
                         max_tokens=settings.max_job_tokens,
                         weights_dtype=config.weights_dtype)
    store = make_store(settings)
    checkpoints = (settings.checkpoint_every_steps > 0 or settings.checkpoint_every_seconds > 0)
    budget = adapter_budget(settings, config.model)
    adapters = (AdapterCache(lambda key: _read(store, key), checkpoint_family(config.model).name,
                             pipe, budget) if budget else None)
    loop = RankLoop(ctx.rank, pipe, store_writer(store), platform,
                    host_memory_every_seconds=config.report_seconds, layout=layout,
                    preview_every_steps=settings.preview_every_steps,
                    checkpoints=StoreCheckpoints(store) if checkpoints else None,
                    checkpoint_every_steps=settings.checkpoint_every_steps,
                    checkpoint_every_seconds=settings.checkpoint_every_seconds,
                    model_fingerprint=model_fingerprint(config.model), adapters=adapters)
    coordinator = None
    if ctx.rank == 0:
        coordinator = make_coordinator(settings, config, layout, platform.name)
    run_loop(ctx.rank, ctx.world, loop, coordinator, ctx.stop, own_pace=config.own_pace,
             peer_timeout_s=config.collective_timeout_seconds)


def make_coordinator(settings: Settings, config: WorkerConfig, layout: Layout,
                     platform_name: str, **io_options: Any) -> Coordinator:
    """Rank 0's coordinator, against the servers of ``settings`` (``io_options``: `ServerIO`'s
    hooks: ``notify``, ``report``, ``send_event``)."""
    group_id = config.group_id or new_group_id()
    mode = "allgather" if config.use_allgather and layout.world > 1 else "rank_local"
    io = ServerIO(settings, group_id=group_id, model=config.model, sp=layout.sp, **io_options)
    return Coordinator(config, layout, mode, platform_name, io=io, group_id=group_id,
                       lease_seconds=settings.lease_seconds,
                       gives_back_on_failure=under_torchrun())


def run_worker(settings: Settings, config: WorkerConfig,
               on_started: Callable[[], None] | None = None) -> int:
    """Start the group: under torchrun this process is one rank; else spawn ``config.dp`` ranks,
    and start them again when one dies.

    A rank that dies (or raises, or hangs a collective past ``collective_timeout_seconds``) takes
    its group down; the launcher then ends the group's attempts at once, charging only the job
    of the rank that died (`recover_attempts`), and starts a new rank set after a backoff (1 s,
    doubling to 30 s, jittered by `common.retry`; the model reloads from the shared mmap). More
    than ``max_restarts`` restarts within ``restart_window_seconds`` is a crash loop: it gives
    up.

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
    failures = 0  # restarts in a row, for the backoff
    while True:
        group = replace(config, group_id=config.group_id or new_group_id())
        started = time.monotonic()
        try:
            run_ranks(layout.world, serve_rank, settings, group, device=config.device,
                      on_started=on_started, timeout_s=None, graceful_stop=True,
                      stop_timeout_s=config.drain_seconds + STOP_GRACE_SECONDS,
                      collective_timeout_s=config.collective_timeout_seconds)
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
            failures = 0  # it ran well for a while: this is not a loop
        restarts = [t for t in restarts if now - t < config.restart_window_seconds]
        # A crash charged to the job its rank was rendering is that job's (its attempts bound
        # it); the others count towards the crash loop.
        if not charged:
            restarts.append(now)
        else:
            failures = 0
        if len(restarts) > config.max_restarts:
            log.error("the ranks failed %d times within %.0f s; not starting them again",
                      len(restarts), config.restart_window_seconds)
            return 1
        failures += 1
        wait = retry.backoff(failures, first=1.0, cap=MAX_RESTART_BACKOFF_SECONDS)
        log.warning("starting the ranks again in %.0f s", wait)
        if _stop_requested_within(wait):
            return 0


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
                  heads=heads_of(config.model), weights_dtype=config.weights_dtype,
                  adapter_bytes=adapter_budget(settings, config.model))
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
    crashed_ranks = {r for r in failure.ranks
                     if (code := failure.exit_codes.get(r)) is not None
                     and (code > 0 or -code in _CRASH_SIGNALS)}
    if not failure.exit_codes and not any(s in str(failure) for s in _LOST_PEER):
        crashed_ranks = set(failure.ranks)  # a rank raised outside a job's step: its job
    # The replica (named by its first rank) -> the rank of it that crashed.
    crashed = {layout.leader(r): r for r in sorted(crashed_ranks, reverse=True)}
    sessions = make_session_factory(make_engine(settings.database_url))
    redis = Redis.from_url(settings.redis_url) if settings.redis_url else None
    charged: set[str] = set()
    celery: list[Celery] = []  # the app that enqueues webhooks, made when a job ends here

    def notify(session: Session, job_id: str) -> object:
        # Here, not at the top: Celery (20 MiB a process) loads only when a job ended here.
        from kiln.tasks import enqueue_job_finished, make_celery

        if not celery:
            celery.append(make_celery(settings))
        return enqueue_job_finished(celery[0], session, job_id)

    def end_attempts() -> None:
        with sessions() as session:
            held = queries.running_jobs_by_group(session, [group_id]).get(group_id, [])
            for job in held:
                if job.attempt_token is None:
                    continue
                rank, attempt = job.rank, job.attempts  # as they were: the ending clears them
                if rank in crashed:
                    charged.add(job.id)
                    ending = Ending(outcome="failed", error=f"its rank ({crashed[rank]}) "
                                    "crashed while rendering it", code="rank_crashed",
                                    retryable=True)
                else:
                    ending = Ending(outcome="failed", error="another rank of its worker group "
                                    "failed", code="group_failed", retryable=True,
                                    charged=False)
                # A group that ran had REDIS_URL (ServerIO refuses to start without it).
                state = finish_attempt(session, redis,  # type: ignore[arg-type]  # not None
                                       settings.redis_prefix, job.id, job.attempt_token, ending,
                                       notify=notify)
                job_log("recovered", job=job.id, attempt=attempt, replica=rank,
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
        for app in celery:
            app.close()
        sessions.kw["bind"].dispose()
    return len(charged)
