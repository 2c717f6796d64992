"""What every rank of a persistent worker group does, one denoising step per turn.

1. Rank 0 asks its `GroupDriver` (the service's bookkeeping: claims, cancels, leases; it lives
   above the runtime and is handed in) for a `StepPlan` and broadcasts it on a small gloo
   control group.
2. Each rank applies it: a new job is prepared (text encoding, noise: local work); a cancelled
   one is dropped.
3. If any rank has a job, every rank runs one step: ``pipe.step`` on its job, ``pipe.idle_step``
   without one. Each step is the same number of forwards on every rank, so the weight gathers
   stay in lock-step (``runtime.pipelines.base``). A rank whose job has finished decodes it and
   hands the frames to its own writer thread (MP4, thumbnail, output store: the ``write``
   function it is given), and is free for a new job at the next step boundary: the encoding
   (longer than the decode) does not hold up the other ranks, which wait for this one at every
   gather. The job's final status follows when its files are stored.
4. Rank 0 gathers every rank's `RankStatus` and hands them to the driver.

While no rank has work, the driver still returns an empty plan every so often, so the other ranks
never sit in a collective long enough to time out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch.distributed as dist

from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest
from runtime.render import frames_to_uint8, memory_figures

log = logging.getLogger(__name__)

# (uint8 frames [N, H, W, 3] as numpy, job id, fps) -> (video key, thumbnail key), on the
# rank's writer thread.
WriteOutputs = Callable[[Any, str, int], tuple[str, str]]


@dataclass(kw_only=True, slots=True)
class Ticket:
    """A claimed job as a rank needs it: the request (its render fields, the frame rate to write
    included) and the attempt it belongs to."""

    job_id: str
    attempt_token: str
    request: VideoRequest


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """Rank 0's orders for one turn, broadcast to every rank."""

    assign: dict[int, Ticket] = field(default_factory=dict)  # rank -> job to start now
    drop: dict[int, str] = field(default_factory=dict)  # rank -> why its job stops (cancel, lease)
    stop: bool = False  # leave the loop (every rank)
    step: bool = False  # some rank has a job: every rank runs one step


@dataclass(kw_only=True, slots=True)
class RankStatus:
    """One rank's report for one turn, gathered on rank 0."""

    rank: int
    job_id: str | None = None
    attempt_token: str | None = None
    step: int = 0  # steps done
    num_inference_steps: int = 0  # the job's step count
    # None (still running) | "rendered" (the rank is free; the job's files are being written,
    # its final status follows) | "succeeded" | "failed" | "cancelled"
    outcome: str | None = None
    video_key: str | None = None
    thumbnail_key: str | None = None
    error: str | None = None
    retryable: bool = False  # the worker, not the request, was at fault
    compute_seconds: float = 0.0  # this rank's time in its job's steps (excludes idle steps)
    memory: dict[str, Any] = field(default_factory=dict)


class GroupDriver(Protocol):
    """What rank 0 consults every turn: the service's side of the loop."""

    def start(self, memory: dict[str, Any]) -> None:
        """The group has loaded its model (rank 0's memory figures)."""

    def next_plan(self, stop_requested: bool) -> StepPlan:
        """The orders for the next turn; may wait (briefly) for work."""

    def record(self, statuses: list[RankStatus]) -> None:
        """What every rank reported for the turn."""

    def stop(self, memory: dict[str, Any]) -> None:
        """The loop is over (normally or not): hand back what is still running."""


class RankLoop:
    """One rank's side of the loop: its pipeline, its job, its outputs."""

    def __init__(self, rank: int, pipe: VideoPipeline, write: WriteOutputs, platform: Any,
                 host_memory_every_seconds: float = 0.0) -> None:
        self.rank = rank
        self.pipe = pipe
        self.write = write
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

    def apply(self, plan: StepPlan) -> list[RankStatus]:
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
        job_id, fps = self.ticket.job_id, self.ticket.request.fps
        final = self._end(outcome="succeeded")
        self._writing.append((final, self._writer.submit(self.write, frames, job_id, fps)))
        return replace(final, outcome="rendered")

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
                          step=s.step_index if s else 0,
                          num_inference_steps=s.num_inference_steps if s else 0,
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


def run_loop(rank: int, world: int, loop: RankLoop, driver: GroupDriver | None,
             stop_event: Any = None) -> None:
    """Turns until the driver says stop. ``driver``: rank 0's (None on the other ranks);
    ``stop_event``: set when the group is asked to stop after its running jobs."""
    # Plans and statuses are small Python objects: a gloo group carries them on every platform.
    control = dist.new_group(backend="gloo") if loop.platform.is_accelerator else dist.group.WORLD
    if driver is not None:
        driver.start(loop.memory())
    try:
        while True:
            plan_box: list[Any] = [None]
            if driver is not None:
                stop = bool(stop_event is not None and stop_event.is_set())
                plan_box[0] = driver.next_plan(stop)
            dist.broadcast_object_list(plan_box, src=0, group=control)
            plan: StepPlan = plan_box[0]
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
            if driver is not None:
                driver.record([st for per_rank in gathered for st in per_rank])
    finally:
        if driver is not None:
            driver.stop(loop.memory())
        loop.close()
