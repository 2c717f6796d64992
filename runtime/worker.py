"""The persistent worker group: N ranks load the model once through DLO, then render jobs forever.

Every rank runs the same loop, one denoising step per turn:

1. Rank 0 (the coordinator, which also renders) turns what it knows into a ``Plan``: jobs
   claimed for free ranks (``scheduler.claim.claim_for_group``), cancels, stop. The plan is
   broadcast on a small gloo control group.
2. Each rank applies it: a new job is prepared (text encoding, noise: local work); a cancelled
   one is dropped.
3. If any rank has a job, every rank runs one step: ``pipe.step`` on its job, ``pipe.idle_step``
   without one. Each step is the same number of forwards on every rank, so the weight gathers
   stay in lock-step (``runtime.pipelines.base``). A rank whose job has finished decodes it and
   hands the frames to its own writer thread (MP4, thumbnail, output store), and is free for a
   new job at the next step boundary: the encoding (longer than the decode) no longer holds up
   the other ranks, which wait for this one at every gather. The job's final status follows when
   its files are stored.
4. Rank 0 gathers every rank's ``RankStatus`` and writes it down: progress and lease renewal
   (a heartbeat per step, which also reports cancel requests), and the final transition
   (succeeded / failed / cancelled), each guarded by the attempt token.

A rank is given a new job at the first step boundary after its last one ended, while the other
ranks carry on: there are no waves. While no rank has work, rank 0 still broadcasts an empty plan
every ``idle_tick_seconds`` so the other ranks never sit in a collective long enough to time out.

Launch: ``kiln worker --dp N`` spawns N local ranks; under ``torchrun`` each process is one rank
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT`` from the launcher).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.procs import die_with_parent, free_port
from common.settings import Settings
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest
from runtime.platform import get_platform
from runtime.render import frames_to_uint8, load_pipeline, memory_figures

log = logging.getLogger(__name__)


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
    name: str = ""


@dataclass(kw_only=True, slots=True)
class Ticket:
    """A claimed job as a rank needs it: the request and the attempt it belongs to."""

    job_id: str
    attempt_token: str
    request: VideoRequest
    fps: int


@dataclass(kw_only=True, slots=True)
class Plan:
    assign: dict[int, Ticket] = field(default_factory=dict)  # rank -> job to start now
    drop: dict[int, str] = field(default_factory=dict)  # rank -> why its job stops (cancel, lease)
    stop: bool = False  # leave the loop (every rank)
    step: bool = False  # some rank has a job: every rank runs one step


@dataclass(kw_only=True, slots=True)
class RankStatus:
    rank: int
    job_id: str | None = None
    attempt_token: str | None = None
    step: int = 0
    total: int = 0
    # None (still running) | "rendered" (the rank is free; the job's files are being written,
    # its final status follows) | "succeeded" | "failed" | "cancelled"
    outcome: str | None = None
    video_key: str | None = None
    thumbnail_key: str | None = None
    error: str | None = None
    retryable: bool = False  # the worker, not the request, was at fault
    compute_seconds: float = 0.0  # this rank's time in its job's steps (excludes idle steps)
    memory: dict[str, Any] = field(default_factory=dict)


# ---- what every rank does ------------------------------------------------------------------

class RankLoop:
    """One rank's side of the loop: its pipeline, its job, its outputs."""

    def __init__(self, rank: int, pipe: VideoPipeline, store: Any, platform: Any,
                 host_memory_every_seconds: float = 0.0) -> None:
        self.rank = rank
        self.pipe = pipe
        self.store = store
        self.platform = platform
        self.ticket: Ticket | None = None
        self.state: DenoiseState | None = None
        self.compute_seconds = 0.0  # spent in the current job's steps
        # Finished jobs whose files the writer thread is storing: their final status, to be
        # sent once the future is done.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"kiln-writer-{rank}")
        self._writing: list[tuple[RankStatus, Future[tuple[str, str]]]] = []
        # Reading /proc/self/smaps_rollup walks every mapping (the mmapped weights included):
        # milliseconds per read, so it is read once per report, not once per step.
        self.host_memory_every_seconds = host_memory_every_seconds
        self._host_memory = (0, -float("inf"))  # (PSS bytes, when it was read)

    def apply(self, plan: Plan) -> list[RankStatus]:
        """Drop and/or start this rank's job; statuses of jobs that this ended."""
        ended = []
        if self.rank in plan.drop and self.ticket is not None:
            ended.append(self._end(outcome="cancelled", error=plan.drop[self.rank]))
        ticket = plan.assign.get(self.rank)
        if ticket is not None:
            self.ticket = ticket
            try:
                self.state = self.pipe.prepare(ticket.request)
            except Exception as exc:  # a request the model cannot run: fail this job only
                log.exception("rank %d: preparing job %s failed", self.rank, ticket.job_id)
                ended.append(self._end(outcome="failed", error=f"could not start: {exc}"))
        return ended

    def step(self) -> RankStatus | None:
        """One lock-step turn: this rank's step (or an idle one); a status if the job ended."""
        if self.state is None:
            self.pipe.idle_step()
            return None
        started = time.perf_counter()
        try:
            self.pipe.step(self.state)
        except Exception as exc:
            # pipe.step has already issued the gathers this step did not, so the other ranks'
            # forwards complete; only this job fails.
            log.exception("rank %d: step failed for job %s", self.rank, self._job_id())
            return self._end(outcome="failed", error=f"render failed: {exc}")
        self.compute_seconds += time.perf_counter() - started
        if not self.state.done:
            return None
        assert self.ticket is not None
        try:
            frames = frames_to_uint8(self.pipe.decode(self.state)).cpu().numpy()
        except Exception as exc:
            log.exception("rank %d: writing outputs of job %s failed", self.rank, self._job_id())
            return self._end(outcome="failed", error=f"writing the video failed: {exc}",
                             retryable=True)
        job_id, fps = self.ticket.job_id, self.ticket.fps
        final = self._end(outcome="succeeded")
        self._writing.append((final, self._writer.submit(self._write_outputs, frames, job_id,
                                                         fps)))
        return replace(final, outcome="rendered")

    def _write_outputs(self, frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        """On the writer thread: the MP4 and thumbnail, into the output store."""
        from storage.outputs import thumbnail_key, video_key
        from storage.video import write_outputs

        with tempfile.TemporaryDirectory(prefix="kiln-out-") as tmp:
            video, thumb = write_outputs(frames, Path(tmp) / f"{job_id}.mp4", fps=fps)
            self.store.put(video_key(job_id), Path(video))
            self.store.put(thumbnail_key(job_id), Path(thumb))
        return video_key(job_id), thumbnail_key(job_id)

    def written(self, wait: bool = False) -> list[RankStatus]:
        """Final statuses of the jobs whose files are now stored (all of them with ``wait``)."""
        done, still = [], []
        for final, future in self._writing:
            if not (wait or future.done()):
                still.append((final, future))
                continue
            try:
                video_key, thumb_key = future.result()
            except Exception as exc:
                log.error("rank %d: writing outputs of job %s failed", self.rank, final.job_id,
                          exc_info=exc)
                done.append(replace(final, outcome="failed", retryable=True,
                                    error=f"writing the video failed: {exc}"))
            else:
                done.append(replace(final, video_key=video_key, thumbnail_key=thumb_key))
        self._writing = still
        return done

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.pipe.close()

    def _job_id(self) -> str | None:
        return self.ticket.job_id if self.ticket else None

    def _end(self, **kwargs: Any) -> RankStatus:
        status = self._status(**kwargs)
        self.ticket = self.state = None
        self.compute_seconds = 0.0
        return status

    def _status(self, **kwargs: Any) -> RankStatus:
        t, s = self.ticket, self.state
        return RankStatus(rank=self.rank, job_id=t.job_id if t else None,
                          attempt_token=t.attempt_token if t else None,
                          step=s.step_index if s else 0, total=s.num_steps if s else 0,
                          compute_seconds=self.compute_seconds, **kwargs)

    def progress(self) -> RankStatus:
        """The running job's step count (no outcome yet)."""
        return self._status()

    def memory(self) -> dict[str, Any]:
        free, total = self.platform.mem_get_info()
        pss, read_at = self._host_memory
        if time.monotonic() - read_at >= self.host_memory_every_seconds:
            _, pss, _ = memory_figures()
            self._host_memory = (pss, time.monotonic())
        return {"rank": self.rank, "device": str(self.platform.device),
                "device_mem_used_bytes": total - free, "device_mem_total_bytes": total,
                "host_mem_bytes": pss, "job_id": self._job_id()}


# ---- what rank 0 does besides ---------------------------------------------------------------

class Coordinator:
    """Rank 0's bookkeeping against the database and Redis."""

    def __init__(self, settings: Settings, config: WorkerConfig, world: int, mode: str,
                 platform_name: str) -> None:
        from redis import Redis

        from storage.db import make_engine, make_session_factory

        self.settings = settings
        self.config = config
        self.world = world
        self.mode = mode
        self.platform_name = platform_name
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
        self._last_report = 0.0
        self._last_work = time.monotonic()

    # The plan for the next step.
    def next_plan(self, stop_requested: bool) -> Plan:
        deadline = time.monotonic() + self.config.idle_tick_seconds
        while True:
            if stop_requested and not self.stopping:
                log.info("worker group %s: stopping after the running jobs", self.group_id)
                self.stopping = True
            plan = Plan(drop=dict(self.cancels))
            self.cancels.clear()
            for rank in plan.drop:
                self.running.pop(rank, None)
            free = [r for r in range(self.world) if r not in self.running]
            if free and not self.stopping:
                plan.assign = self._claim(free)
                self.running.update(plan.assign)
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

    def _wait_for_work(self) -> None:
        """Up to ``poll_seconds``, cut short when a submission announces work in Redis."""
        from redis import RedisError

        from storage.ready import wait_for_work

        try:
            wait_for_work(self.redis, self.settings.redis_prefix, self.config.poll_seconds)
        except RedisError:
            time.sleep(self.config.poll_seconds)  # the claim that follows reports the outage

    def _claim(self, free: list[int]) -> dict[int, Ticket]:
        from scheduler.claim import claim_for_group
        from scheduler.policy import RunningJob

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
            request = VideoRequest(
                prompt=job.prompt, negative_prompt=job.negative_prompt or "", width=job.width,
                height=job.height, num_frames=job.num_frames,
                num_steps=job.num_inference_steps, seed=job.seed,
                guidance_scale=job.guidance_scale)
            tickets[rank] = Ticket(job_id=job.id, attempt_token=claim.attempt_token,
                                   request=request, fps=job.fps)
            self.steps_left[rank] = job.num_inference_steps
        return tickets

    # What happened in the step.
    def record(self, statuses: list[RankStatus]) -> None:
        from storage import jobs

        lease = self.settings.lease_seconds
        with self.sessions() as session:
            for st in statuses:
                if st.job_id is None or st.attempt_token is None:
                    continue
                if st.outcome is None:
                    self.steps_left[st.rank] = st.total - st.step
                    beat = jobs.heartbeat(session, st.job_id, st.attempt_token, step=st.step,
                                          total=st.total, lease_seconds=lease)
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
        now = time.monotonic()
        if now - self._last_report >= self.config.report_seconds:
            self.report([st.memory for st in statuses if st.memory])
            self._last_report = now

    def _finish(self, session: Any, st: RankStatus) -> None:
        from storage import jobs, ready
        from storage.models import Job

        assert st.job_id is not None and st.attempt_token is not None
        if st.outcome == "succeeded":
            assert st.video_key is not None
            if jobs.finish_succeeded(session, st.job_id, st.attempt_token,
                                     video_key=st.video_key, thumbnail_key=st.thumbnail_key):
                self._learn_cost(session, st)
        elif st.outcome == "cancelled":
            if not jobs.finish_cancelled(session, st.job_id, st.attempt_token):
                log.info("job %s: dropped (%s)", st.job_id, st.error)
        else:
            state = jobs.fail_job(session, st.job_id, st.attempt_token,
                                  error=st.error or "render failed", retryable=st.retryable)
            if state is not None and state.value == "queued":
                job = session.get(Job, st.job_id)
                if job is not None:
                    ready.add(self.redis, self.settings.redis_prefix, [job])
        # After the commit: its webhook goes out now rather than at the next sweep (best effort;
        # this never raises, and does nothing for a job that is not finished or has no webhook).
        from kiln.tasks import enqueue_job_finished

        enqueue_job_finished(session, st.job_id)

    def _learn_cost(self, session: Any, st: RankStatus) -> None:
        """Teach the batcher this job's real cost (its rank's own step time, not lock-step
        wall time, which includes waiting for slower ranks)."""
        from redis.exceptions import RedisError

        from scheduler.claim import job_tokens, record_result
        from storage.models import Job

        job = session.get(Job, st.job_id)
        if job is None:
            return
        try:
            record_result(self.redis, prefix=self.settings.redis_prefix, job_id=job.id,
                          model=job.model, num_tokens=job_tokens(job), num_steps=st.total,
                          render_seconds=st.compute_seconds)
        except RedisError:
            log.warning("could not record the cost of job %s", job.id, exc_info=True)

    def report(self, ranks: list[dict[str, Any]], state: str = "ready") -> None:
        from storage.workers import GroupReport, report_group

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
            report_group(session, report)

    def give_back(self) -> None:
        """On the way out: jobs still running go back to the queue (the worker stopped)."""
        from storage import jobs, ready
        from storage.models import Job

        attempts = [(t.job_id, t.attempt_token) for t in self.running.values()]
        attempts += [(job_id, st.attempt_token) for job_id, st in self.writing.items()]
        with self.sessions() as session:
            for job_id, token in attempts:
                state = jobs.fail_job(session, job_id, token or "",
                                      error="the worker group stopped", code="worker_stopped",
                                      retryable=True)
                job = session.get(Job, job_id)
                if state is not None and state.value == "queued" and job is not None:
                    ready.add(self.redis, self.settings.redis_prefix, [job])
        self.running.clear()
        self.writing.clear()


# ---- the loop -------------------------------------------------------------------------------

def run_rank(rank: int, world: int, settings: Settings, config: WorkerConfig,
             stop_event: Any = None) -> None:
    """Everything one rank does, from loading the model to leaving the group."""
    from storage.outputs import make_store

    platform = get_platform(_device_for(config.device))
    # Plans and statuses are small Python objects: a gloo group carries them on every platform.
    control = dist.new_group(backend="gloo") if platform.is_accelerator else dist.group.WORLD
    pipe = load_pipeline(config.model, device=platform.device,
                         use_allgather=config.use_allgather)
    loop = RankLoop(rank, pipe, make_store(settings), platform,
                    host_memory_every_seconds=config.report_seconds)
    coordinator = None
    if rank == 0:
        mode = "allgather" if config.use_allgather and world > 1 else "rank_local"
        coordinator = Coordinator(settings, config, world, mode, platform.name)
        coordinator.report([loop.memory()], state="starting")
        log.info("worker group %s: %d rank(s), model %s, %s", coordinator.group_id, world,
                 config.model, mode)
    try:
        while True:
            plan_box: list[Any] = [None]
            if coordinator is not None:
                stop = bool(stop_event is not None and stop_event.is_set())
                plan_box[0] = coordinator.next_plan(stop)
            dist.broadcast_object_list(plan_box, src=0, group=control)
            plan: Plan = plan_box[0]
            if plan.stop:
                break
            statuses = loop.apply(plan)
            if plan.step:
                ended = loop.step()
                if ended is not None:
                    statuses.append(ended)
            # Files written meanwhile; on a turn without a step, every pending one.
            statuses.extend(loop.written(wait=not plan.step))
            if loop.ticket is not None:
                statuses.append(loop.progress())
            statuses.append(RankStatus(rank=rank, memory=loop.memory()))
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(statuses, gathered if rank == 0 else None, dst=0, group=control)
            if coordinator is not None:
                coordinator.record([st for per_rank in gathered for st in per_rank])
    finally:
        if coordinator is not None:
            coordinator.give_back()
            coordinator.report([loop.memory()], state="stopped")
        loop.close()


def _device_for(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(device, local)


def _init(rank: int, world: int, device: str) -> None:
    if device != "cpu":
        mod = torch.cuda if device == "cuda" else torch.npu  # type: ignore[attr-defined]
        mod.set_device(_device_for(device))
    backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device]
    dist.init_process_group(backend, rank=rank, world_size=world)


def _spawned_rank(rank: int, world: int, port: int, settings: Settings, config: WorkerConfig,
                  stop_event: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    die_with_parent()  # a rank whose launcher died must not go on claiming jobs
    # Ctrl-C reaches the whole process group; the parent turns it into a graceful stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    _init(rank, world, config.device)
    try:
        run_rank(rank, world, settings, config, stop_event)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_worker(settings: Settings, config: WorkerConfig,
               on_started: Callable[[], None] | None = None) -> int:
    """Start the group: under torchrun this process is one rank; else spawn ``config.dp`` ranks.

    Returns an exit code: 0 after a graceful stop, 1 if a rank died.
    """
    if config.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {config.dp}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world, config.device)
        try:
            run_rank(rank, world, settings, config)
        finally:
            dist.destroy_process_group()
        return 0
    ctx = mp.get_context("spawn")
    stop_event = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank,
                         args=(r, config.dp, port, settings, config, stop_event))
             for r in range(config.dp)]
    for p in procs:
        p.start()

    def request_stop(signum: int, frame: Any) -> None:
        if stop_event.is_set():  # a second signal: do not wait for the running jobs
            for p in procs:
                p.terminate()
        stop_event.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    if on_started is not None:
        on_started()
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                # One rank died: the others would wait for it in the next collective forever.
                for p in procs:
                    p.terminate()
                break
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            p.join(timeout=10)
    return 0 if all(p.exitcode == 0 for p in procs) else 1
