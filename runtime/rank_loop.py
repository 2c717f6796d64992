"""What every rank of a persistent worker group does, one denoising step per turn.

Two ways to turn (`run_loop`): in lock-step, below, where a step gathers weights across ranks
(allgather mode) and every rank must run every step together; and at their own pace
(`_own_pace_turns`), where nothing is gathered (rank-local weights, every block resident): each
replica then steps its own job as fast as it goes, its orders and reports going through queues
on the group's store (`runtime.mailbox`) and rank 0's coordinator running on a thread of its
own; a replica of one rank looks at its orders between the modules of a step too, and leaves the
step part-way for orders that want it now (`_Interrupt`: a preemption waits for a layer, not a
step). The same `GroupDriver`, `StepPlan` and messages serve both.

In lock-step:

1. Rank 0 asks its `GroupDriver` (the service's bookkeeping: claims, cancels, leases; it lives
   above the runtime and is handed in) for a `StepPlan` and broadcasts it on a small gloo
   control group.
2. Each rank applies it: a new job is prepared (text encoding, noise: local work); a cancelled
   one is dropped.
3. If any rank has a job, every rank runs one step: ``pipe.step`` on its job, ``pipe.idle_step``
   without one. Each step is the same number of forwards on every rank, so the weight gathers
   stay in lock-step (``runtime.pipelines.base``). A rank whose job has finished decodes it and
   hands the frames (and the soundtrack, where the pipeline makes one and the job wants it) to
   its own writer thread (MP4, thumbnail, output store: the ``write`` function it is given),
   and is free for a new job at the next step boundary: the encoding (longer than the decode)
   does not hold up the other ranks, which wait for this one at every gather. The job's final
   status follows when its files are stored. A step of batch work only may be left part-way,
   by every rank at once (`StepPlan.leavable`, `GroupDriver.leave_step`,
   `VideoPipeline.leave_steps_when`): an interactive job that preempts it then waits for part
   of a block, not for the rest of the step, and the jobs take the step again from its start.
4. Rank 0 gathers every rank's messages (`Progress`, `Rendered`, `Ended`, `RankReport`) and hands
   them to the driver.

Replicas (``runtime.sequence.Layout``): with ``sp > 1`` the ranks of a replica run one job
together, its token sequence split over them; the plan names a replica by its first rank, and
that rank (the leader) decodes, stores and reports the job, while the others only take part.
With ``sp == 1`` every rank is a replica of its own.

A write the storage refuses (``write`` raises ``OSError``: a full or read-only output directory,
an object store that cannot be reached) is no fault of the render: the writer thread keeps the
job (its frames; ``write`` keeps what it encoded) and tries again with a backoff (1 s doubling to
30 s) until it is stored, never rendering it again. A rank holds at most ``max_held_jobs``
finished jobs waiting for their files; at the bound it takes no new job (`RankReport.takes_jobs`)
and the driver sees why (`RankReport.store_error`). A job the driver gives up (`StepPlan.abandon`:
its attempt was handed back) is dropped, and so is every job still held when the loop ends.

Previews: where the pipeline offers them (``can_preview``) and ``write`` stores them, a replica's
leader takes one every ``preview_every_steps`` steps of its job (at most every
``PREVIEW_MIN_SECONDS``), after the step: the decode of one frame is the only time it adds to the
lock-step turn. It hands the frame to a preview thread of its own, which stores it in place of the
last (``write.preview``) and deletes it when the job ends (``write.drop_preview``). Only the
newest preview waits for that thread; a preview that fails, to decode or to store, is logged and
skipped: it never fails the job, holds up its files, or counts as a store fault.

While no rank has work, the driver still returns an empty plan every so often, so the other ranks
never sit in a collective long enough to time out.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from common import logs, retry
from common.procs import cgroup_memory_bytes
from runtime import resume
from runtime.adapter_cache import AdapterCache, AdapterRef
from runtime.mailbox import Mailbox, open_mailbox
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest, agree_handles
from runtime.render import frames_to_uint8, memory_figures, soundtrack
from runtime.sequence import SOLO, Layout
from runtime.step_replay import StepLeft
from storage.video import Soundtrack

log = logging.getLogger(__name__)

# (uint8 frames [N, H, W, 3] as numpy, job id, fps) -> (video key, thumbnail key), on the
# rank's writer thread. It raises OSError when the storage failed (the job is kept and tried
# again), anything else when these frames cannot be written (the job fails). It may have
# ``discard(job_id)`` (drop what it keeps for a job given up) and ``close()``, and for previews
# ``preview(frame [H, W, 3] uint8 numpy, job_id, step, num_inference_steps)`` and
# ``drop_preview(job_id)``, called on the rank's preview thread. A job with a soundtrack is
# written with it as a fourth argument (a `storage.video.Soundtrack`); one without, as before.
WriteOutputs = Callable[..., tuple[str, str]]

# While the storage refuses a rank's writes, the writer thread waits this long before the first
# try again, doubling up to the most.
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 30.0
# Finished jobs a rank may hold while their files are written (each keeps its decoded frames);
# at this many the rank takes no new job.
MAX_HELD_JOBS = 2
# The longest a turn without a step waits for a rank's writes.
WRITE_WAIT_SECONDS = 1.0
# The least time between two previews a rank takes: the job page asks for one at most this often
# (on the job's progress events), and a fast job (kiln-tiny: 16 ms a step) would otherwise put a
# PNG into the store every few milliseconds.
PREVIEW_MIN_SECONDS = 0.5
# A replica's leader logs its job's first and last steps, and one step at least this often
# between them: every step of a long one (Wan: tens of seconds a step), a few of a fast one
# (kiln-tiny: milliseconds).
STEP_LOG_SECONDS = 10.0
# On the way out, how long a rank waits for a try of its writer thread that is under way (the
# thread is a daemon: one that hangs does not keep the process).
CLOSE_WAIT_SECONDS = 5.0


@dataclass(kw_only=True, slots=True)
class Ticket:
    """A claimed job as a rank needs it: the request (its render fields, the frame rate to write
    included), the attempt it belongs to, and whether its video gets the soundtrack the
    pipeline makes (``audio``; a pipeline without sound writes none either way)."""

    job_id: str
    attempt_token: str
    attempt: int = 0  # its number (1 for a first claim), for the log lines
    request: VideoRequest
    audio: bool = True
    # Its LoRA adapters, loaded by each rank of the replica when it takes the job (`adapters`).
    adapters: tuple[AdapterRef, ...] = ()


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """Rank 0's orders for one turn, broadcast to every rank."""

    # Keyed by a replica's first rank (with sp=1, every rank is a replica of its own). A job
    # given to a replica that holds one already is held beside it, and runs first unless ``run``
    # says otherwise: the other is suspended in place, its state kept on the rank.
    assign: dict[int, Ticket] = field(default_factory=dict)  # replica -> job to take now
    drop: dict[str, str] = field(default_factory=dict)  # job id -> why it stops (cancelled)
    # Jobs handed back to the queue: their state is checkpointed (where checkpoints are kept),
    # then dropped, so the next attempt resumes from this step.
    hand_back: list[str] = field(default_factory=list)
    # replica -> the held job it computes this turn; a replica holding jobs that is not named
    # sits the turn out (it joins the gathers without computing). None: every replica runs the
    # job it took last.
    run: dict[int, str] | None = None
    # Finished jobs whose files are no longer wanted (their attempts ended meanwhile: handed
    # back, lease lost): the ranks holding them drop them, stored or not.
    abandon: list[str] = field(default_factory=list)
    stop: bool = False  # leave the loop (every rank)
    step: bool = False  # some rank has a job: every rank runs one step
    # Replicas at their own pace: these replicas stop (a replica of one rank part-way through a
    # step, which it takes again later: `_Interrupt`; else at its next step boundary), report
    # (`RankReport.waiting`) and wait up to HOLD_SECONDS for their next orders before they step
    # again: a job about to be claimed for them (an interactive one that preempts their batch
    # job) then starts at once rather than after the step it arrived in.
    hold: list[int] = field(default_factory=list)
    # Replicas at their own pace that sit out, from their next layer (a replica of one rank) or
    # step boundary on, keeping their jobs, until orders name a job for them to run (``run`` or
    # ``assign``): on a host whose replicas share its cores, a batch replica while interactive
    # work runs on another (`scheduler.turns`, as a lock-step turn leaves it out of ``run``).
    pause: list[int] = field(default_factory=list)
    # In lock-step, a step of weight-gathering replicas that the group may leave between two
    # blocks, whenever rank 0's driver says so (`GroupDriver.leave_step`): an interactive job
    # that preempts the batch work of this turn then waits for a block, not for the step.
    leavable: bool = False


# What the ranks tell rank 0 after each turn, gathered there and handed to the driver: one
# message per held job (`Progress`), per job whose frames are done (`Rendered`) or whose attempt
# ended (`Ended`), and each rank's own `RankReport`. A job's messages come from its replica's
# first rank, and ``rank`` is that rank.


@dataclass(kw_only=True, slots=True)
class Progress:
    """A job its replica holds, after the turn: its step, and whether it computed this turn
    (False: it sat the turn out, or is suspended beside another job)."""

    rank: int
    job_id: str
    attempt_token: str
    step: int  # steps done
    num_inference_steps: int  # the job's step count
    compute_seconds: float = 0.0  # this attempt's time in its own steps (not in idle turns)
    # The step this attempt resumed from (a checkpoint of an earlier attempt); None: step 0.
    resumed_from_step: int | None = None
    computed: bool = True
    # This attempt's compute lost to steps left part-way: what they ran past the blocks they
    # keep (`runtime.step_replay`), all told.
    lost_seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class Rendered:
    """A job's frames are done and its replica is free of it; its files are being stored, and
    its `Ended` follows once they are."""

    rank: int
    job_id: str
    attempt_token: str
    num_inference_steps: int
    compute_seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class Ended:
    """A job's attempt is over on its replica: its final status."""

    rank: int
    job_id: str
    attempt_token: str
    attempt: int = 0  # its number (the ticket's), for the log lines
    outcome: str  # "succeeded" | "failed" | "cancelled"
    step: int = 0
    num_inference_steps: int = 0
    video_key: str | None = None
    thumbnail_key: str | None = None
    has_audio: bool | None = None  # stored: whether the video has a soundtrack
    error: str | None = None
    retryable: bool = False  # the worker, not the request, was at fault
    compute_seconds: float = 0.0
    # What this attempt's steps cost on the replica's leader (`VideoPipeline.last_step_figures`):
    # the block gathers it took part in, and the blocks it computed where a step cache counts
    # them (None where none does).
    gathers: int = 0
    blocks_computed: int | None = None


@dataclass(kw_only=True, slots=True)
class RankReport:
    """A rank's own state, every turn: its memory, whether it may be given a new job (False
    while it holds as many finished jobs waiting for their files as it may), and the storage's
    last error while its writes keep failing."""

    rank: int
    memory: dict[str, Any] = field(default_factory=dict)
    takes_jobs: bool = True
    store_error: str | None = None
    waiting: bool = False  # stopped on a `StepPlan.hold` or `pause`, waiting for orders


RankMessage = Progress | Rendered | Ended | RankReport


class StepInterrupted(StepLeft):
    """A replica at its own pace left its step part-way, between two layers, for orders that
    came meanwhile (`_Interrupt`). The job's state is as it was before it, and the job takes
    the step again when it next runs, the blocks it computed given back (`runtime.step_replay`).
    """


@dataclass(slots=True)
class _Preview:
    """A running job's newest preview frame, waiting for the preview thread."""

    job_id: str
    step: int
    num_inference_steps: int
    frame: Any  # uint8 [H, W, 3]


@dataclass(eq=False, slots=True)
class _Job:
    """A job this rank holds: its ticket, its denoising state, and what it cost so far."""

    ticket: Ticket
    state: DenoiseState
    compute_seconds: float = 0.0  # spent in this attempt's steps
    gathers: int = 0  # in this attempt's steps
    interrupted_steps: int = 0  # steps left part-way for orders (`StepInterrupted`)
    lost_seconds: float = 0.0  # compute those steps ran past the blocks they kept
    blocks_computed: int | None = None  # in this attempt's steps, where a step cache counts
    resumed_from_step: int | None = None
    checkpointed_step: int = 0  # the step of its newest checkpoint (or where it started)
    checkpointed_at: float = 0.0  # monotonic
    step_logged_at: float = -float("inf")  # monotonic: when a line last logged its step


class Checkpoints(Protocol):
    """Where a replica's leader keeps its jobs' denoising states (`runtime.resume`), by job id:
    the output store, handed in. ``save`` raises OSError when the store refuses."""

    def load(self, job_id: str) -> bytes | None: ...

    def save(self, job_id: str, blob: bytes) -> None: ...

    def delete(self, job_id: str) -> None: ...


@dataclass(eq=False, slots=True)
class _Held:
    """A finished job whose files the writer thread is storing."""

    final: Ended  # its status once stored
    frames: Any  # uint8 [N, H, W, 3], kept until the files are stored
    fps: int
    audio: Soundtrack | None = None  # its soundtrack, written with the frames
    # Its `Rendered` has reached rank 0 (`RankLoop.reported`): only then is it written, so
    # that its `Ended` can never overtake it.
    announced: bool = False


class GroupDriver(Protocol):
    """What rank 0 consults every turn: the service's side of the loop."""

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        """The group has loaded its model (rank 0's memory figures). ``own_pace``: its replicas
        step at their own pace (`next_plan` is then called whenever a replica has reported,
        and its ``run`` and ``step`` are a replica's choice of job, not a turn's)."""

    def next_plan(self, stop_requested: bool) -> StepPlan:
        """The orders for the next turn; may wait (briefly) for work."""

    def record(self, messages: list[RankMessage]) -> None:
        """What every rank reported for the turn."""

    def leave_step(self) -> bool:
        """Asked on rank 0 between two blocks of a `StepPlan.leavable` step: whether the group
        leaves the step there (the next plan has a job for a replica of this turn)."""

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        """The loop is over: normally (hand back what is still running), or ``failed`` (an
        exception, often a peer lost: whoever restarts the group decides what to charge)."""


def _about(ticket: Ticket) -> dict[str, Any]:
    """``extra=`` for a line about ``ticket``'s job: its id and attempt as the line's fields."""
    return logs.fields(job=ticket.job_id, attempt=ticket.attempt or None)


class RankLoop:
    """One rank's side of the loop: its pipeline, its job, its outputs."""

    def __init__(self, rank: int, pipe: VideoPipeline, write: WriteOutputs, platform: Any,
                 host_memory_every_seconds: float = 0.0,
                 max_held_jobs: int = MAX_HELD_JOBS, layout: Layout = SOLO,
                 preview_every_steps: int = 0, checkpoints: Checkpoints | None = None,
                 checkpoint_every_steps: int = 0, checkpoint_every_seconds: float = 0.0,
                 model_fingerprint: str = "", adapters: AdapterCache | None = None) -> None:
        self.rank = rank
        self.adapters = adapters  # the loaded LoRA adapters (None: this rank takes none)
        self.layout = layout
        # The replica this rank renders with, named by its first rank; only that rank (the
        # leader) decodes, stores and reports the replica's job.
        self.slot = layout.leader(rank)
        self.leads = layout.is_leader(rank)
        self.pipe = pipe
        self.write = write
        self.platform = platform
        self.max_held_jobs = max_held_jobs
        # The jobs this rank holds, in the order it took them; the one it computes this turn
        # is ``current`` (the last taken, unless the plan names another).
        self.jobs: list[_Job] = []
        self.current: _Job | None = None
        # Set by `run_loop`: this replica steps at its own pace (`_own_pace_turns`).
        self.own_pace = False
        self.interrupted = False  # the last step was left part-way (`StepInterrupted`)
        # Checkpoints of the jobs' denoising states: read by every rank of a replica when it
        # takes a job (it resumes where an earlier attempt stopped), written by the leader
        # every ``checkpoint_every_steps`` steps or ``checkpoint_every_seconds`` (whichever
        # comes first; 0: never) off the step's path, and at every hand-back.
        self.checkpoints = checkpoints
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self.model_fingerprint = model_fingerprint
        self._to_checkpoint: dict[str, bytes] = {}  # job id -> newest blob, under ``_writes``
        self._checkpoints_ended: list[str] = []  # jobs whose checkpoint is to be deleted
        # Jobs whose step failed this turn: their checkpoints are deleted once the turn's
        # messages have reached rank 0 (`reported`). A step fails too when a peer of the rank
        # died under its collectives; the group then fails before it reports, and the
        # checkpoint stays for the attempt the launcher gives the job next.
        self._failed_steps: list[str] = []
        # The writer thread's work, under ``_writes``: finished jobs whose files it is storing
        # (oldest first, the one it tries), the final statuses of those stored since the last
        # turn, and the storage's last error while it keeps failing.
        self._writes = threading.Condition()
        self._held: list[_Held] = []
        self._stored: list[Ended] = []
        # Where the final statuses of stored jobs go at once, from the writer thread (replicas
        # at their own pace: rank 0 learns of an interactive job's end while its replica is in
        # the next step of the job it suspended); None: `written` hands them to the loop.
        self.send_stored: Callable[[list[Ended]], None] | None = None
        self.store_error: str | None = None
        self._closing = False
        self._writer = threading.Thread(target=self._write_held, daemon=True,
                                        name=f"kiln-writer-{rank}")
        self._writer.start()
        # Previews (0: none): the leader's, of a pipeline that offers them, into a ``write``
        # that stores them. The preview thread takes ``_preview`` (the newest) and the jobs whose
        # preview is to be deleted, under ``_writes``.
        self.preview_every_steps = preview_every_steps if (
            preview_every_steps > 0 and self.leads and pipe.can_preview
            and hasattr(write, "preview") and hasattr(write, "drop_preview")) else 0
        self._preview: _Preview | None = None
        self._previews_ended: list[str] = []
        self._last_preview = -float("inf")  # when this rank last took one (monotonic)
        if self.preview_every_steps:
            self._previewer = threading.Thread(target=self._store_previews, daemon=True,
                                               name=f"kiln-preview-{rank}")
            self._previewer.start()
        if checkpoints is not None and self.leads:
            self._checkpointer = threading.Thread(target=self._store_checkpoints, daemon=True,
                                                  name=f"kiln-checkpoints-{rank}")
            self._checkpointer.start()
        # Reading /proc/self/smaps_rollup walks every mapping (the mmapped weights included):
        # milliseconds per read, so it is read once per report, not once per step.
        self.host_memory_every_seconds = host_memory_every_seconds
        self._host_memory = (0, -float("inf"))  # (PSS bytes, when it was read)

    @property
    def ticket(self) -> Ticket | None:
        """The ticket of the job this rank computes this turn."""
        return self.current.ticket if self.current else None

    @property
    def state(self) -> DenoiseState | None:
        """The denoising state of the job this rank computes this turn."""
        return self.current.state if self.current else None

    def apply(self, plan: StepPlan) -> list[Ended]:
        """Drop, hand back and/or take jobs, and choose the one to compute this turn; the ends
        of the jobs that this ended."""
        if plan.abandon:
            self.abandon(plan.abandon)
        ended = []
        for job in list(self.jobs):
            job_id = job.ticket.job_id
            if job_id in plan.hand_back:
                self._checkpoint_now(job)
                ended.append(self._end(job, outcome="cancelled", error="handed back",
                                       keep_checkpoint=True))
            elif job_id in plan.drop:
                ended.append(self._end(job, outcome="cancelled", error=plan.drop[job_id]))
        ticket = plan.assign.get(self.slot)
        if ticket is not None:
            try:
                self.jobs.append(self._take(ticket))
            except Exception as exc:  # a request the model cannot run: fail this job only
                log.exception("rank %d: preparing job %s failed", self.rank, ticket.job_id,
                              extra=_about(ticket))
                ended.append(Ended(rank=self.rank, job_id=ticket.job_id,
                                   attempt_token=ticket.attempt_token, outcome="failed",
                                   error=f"could not start: {exc}"))
        chosen_id = plan.run.get(self.slot) if plan.run is not None else None
        chosen = next((j for j in self.jobs if j.ticket.job_id == chosen_id), None)
        if self.own_pace:
            # The orders may be older than what the replica did since (the job they name has
            # ended): a replica at its own pace always runs one of its jobs.
            if chosen is not None:
                self.current = chosen
            elif ticket is not None or self.current not in self.jobs:
                self.pick()
        elif plan.run is None:
            self.pick()
        else:
            self.current = chosen
        # The replica's other ranks end its job with it; the leader speaks for them.
        return ended if self.leads else []

    def pick(self) -> None:
        """The job this rank computes next when nobody chose: the last it took (a job handed to
        a busy replica runs before the one it found there)."""
        self.current = self.jobs[-1] if self.jobs else None

    def _take(self, ticket: Ticket) -> _Job:
        """A new job's state: from the newest checkpoint of an earlier attempt when there is a
        compatible one, else from step 0. Its adapters are loaded here, before any step."""
        request = self._with_adapters(ticket)
        blob = None
        if self.checkpoints is not None:
            try:
                blob = self.checkpoints.load(ticket.job_id)
            except Exception as exc:
                log.warning("rank %d: job %s's checkpoint could not be read (%s); it starts "
                            "from step 0", self.rank, ticket.job_id, _one_line(exc))
        if blob is not None:
            try:
                state = resume.restore(self.pipe, request, blob,
                                       model_fingerprint=self.model_fingerprint)
            except resume.IncompatibleCheckpoint as exc:
                log.warning("rank %d: job %s's checkpoint is not used: %s; it starts from "
                            "step 0", self.rank, ticket.job_id, exc)
            else:
                log.info("rank %d: job %s resumes from step %d of %d", self.rank,
                         ticket.job_id, state.step_index, state.num_inference_steps,
                         extra=_about(ticket))
                return _Job(ticket, state, resumed_from_step=state.step_index,
                            checkpointed_step=state.step_index, checkpointed_at=time.monotonic())
        job = _Job(ticket, self.pipe.prepare(request), checkpointed_at=time.monotonic())
        if self.leads:
            log.info("taken: %d steps", job.state.num_inference_steps, extra=_about(ticket))
        return job

    def _with_adapters(self, ticket: Ticket) -> VideoRequest:
        """The ticket's request with its adapters loaded (`runtime.adapter_cache`). A job
        without adapters taken when no held job has any takes the adapters' hooks off first, so
        it pays nothing for the jobs with adapters before it."""
        if not ticket.adapters:
            if self.adapters is not None and not any(j.ticket.adapters for j in self.jobs):
                self.adapters.unhook()
            return ticket.request
        if self.adapters is None:
            raise ValueError("this worker takes no adapters")
        return replace(ticket.request, adapters=self.adapters.get(ticket.adapters))

    def step(self, active: Any = None) -> Rendered | Ended | None:
        """One lock-step turn: a step of the job this rank computes (or an idle one: it holds
        none, or sits the turn out); a status if the job ended. ``active``: the transformers
        the group runs this step (`agree_handles`)."""
        job = self.current
        self.interrupted = False
        if job is None:
            self.pipe.idle_step(active)  # returns where the group left the step, if it did
            return None
        started = time.perf_counter()
        try:
            self.pipe.step(job.state, active)
        except StepLeft:
            # Not the job's time: its cost model learns from whole steps. What the step ran past
            # the blocks it keeps is lost.
            job.interrupted_steps += 1
            job.lost_seconds += self.pipe.last_step_lost_seconds
            self.interrupted = True
            return None
        except Exception as exc:
            # pipe.step has already issued the gathers this step did not, so the other ranks'
            # forwards complete; only this job fails.
            log.exception("rank %d: step failed for job %s", self.rank, job.ticket.job_id,
                          extra=_about(job.ticket))
            ended = self._end(job, outcome="failed", error=f"render failed: {exc}",
                              keep_checkpoint=True)
            self._failed_steps.append(job.ticket.job_id)
            return ended if self.leads else None
        job.compute_seconds += time.perf_counter() - started
        figures = self.pipe.last_step_figures
        job.gathers += figures.get("gathers", 0)
        if "blocks_computed" in figures:
            job.blocks_computed = (job.blocks_computed or 0) + figures["blocks_computed"]
        state = job.state
        if self.leads:
            self._log_step(job)
        if not state.done:
            if (self.preview_every_steps
                    and state.step_index % self.preview_every_steps == 0
                    and time.monotonic() - self._last_preview >= PREVIEW_MIN_SECONDS):
                self._take_preview()
            if self._checkpoint_due(job):
                self._checkpoint(job)
            return None
        if not self.leads:  # the replica's leader decodes and stores the video
            self._end(job, outcome="succeeded")
            return None
        try:
            frames = frames_to_uint8(self.pipe.decode(state)).cpu().numpy()
            audio = soundtrack(self.pipe, state) if job.ticket.audio else None
            conditioning = job.ticket.request.conditioning
            if conditioning is not None and conditioning.prefix is not None:
                # An extension: the clip it continues, then the new frames after their first
                # (the clip's last frame, which the render started from).
                frames = np.concatenate([conditioning.prefix.numpy(), frames[1:]])
        except Exception as exc:
            log.exception("rank %d: decoding job %s failed", self.rank, job.ticket.job_id,
                          extra=_about(job.ticket))
            return self._end(job, outcome="failed", error=f"decoding the video failed: {exc}",
                             retryable=True)
        fps = job.ticket.request.fps
        final = self._end(job, outcome="succeeded")
        with self._writes:
            self._held.append(_Held(final, frames, fps, audio))
            self._writes.notify_all()
        return Rendered(rank=self.rank, job_id=final.job_id, attempt_token=final.attempt_token,
                        num_inference_steps=final.num_inference_steps,
                        compute_seconds=final.compute_seconds)

    def _log_step(self, job: _Job) -> None:
        """A line for the step ``job`` has just taken, if it is its first here or its last, or
        STEP_LOG_SECONDS have passed since the last such line."""
        state, now = job.state, time.monotonic()
        if state.done or now - job.step_logged_at >= STEP_LOG_SECONDS:
            job.step_logged_at = now
            log.info("step %d of %d (%.3g s computed)", state.step_index, state.num_inference_steps,
                     job.compute_seconds, extra=_about(job.ticket))

    def written(self, wait: float = 0.0) -> list[Ended]:
        """Final statuses of the jobs whose files were stored (or could not be written) since
        the last call; waits up to ``wait`` seconds for one while any is held."""
        with self._writes:
            if wait > 0:
                self._writes.wait_for(lambda: self._stored or not self._held, timeout=wait)
            done, self._stored = self._stored, []
        return done

    def abandon(self, job_ids: Iterable[str]) -> None:
        """Drops these jobs' files, stored or not: their attempts are over."""
        gone = set(job_ids)
        with self._writes:
            dropped = [h for h in self._held if h.final.job_id in gone]
            self._held = [h for h in self._held if h not in dropped]
            if not self._held:
                self.store_error = None
            self._writes.notify_all()
        for h in dropped:
            log.info("rank %d: job %s given up before its files were stored", self.rank,
                     h.final.job_id)
            self._discard(h.final.job_id)

    def _write_held(self) -> None:
        """The writer thread: stores the held jobs, oldest first; a try the storage refuses is
        tried again after a backoff, until it is stored or given up."""
        failures = 0
        while True:
            with self._writes:
                self._writes.wait_for(lambda: self._closing or self._announced() is not None)
                if self._closing:
                    return
                held = self._announced()
                assert held is not None
            job_id = held.final.job_id
            about = logs.fields(job=job_id, attempt=held.final.attempt or None)
            try:
                sound = () if held.audio is None else (held.audio,)
                video, thumb = self.write(held.frames, job_id, held.fps, *sound)
            except OSError as exc:
                failures += 1
                delay = retry.backoff(failures, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS)
                with self._writes:
                    if held in self._held:
                        if self.store_error is None:
                            log.warning("rank %d: the storage refused job %s's files (%s); the "
                                        "job is kept and tried again, not rendered again",
                                        self.rank, job_id, exc)
                        self.store_error = _one_line(exc)

                    def settled(h: _Held = held) -> bool:
                        return self._closing or h not in self._held

                    self._writes.wait_for(settled, timeout=delay)
                continue
            except Exception as exc:  # these frames cannot be written: the job fails
                log.error("rank %d: writing outputs of job %s failed", self.rank, job_id,
                          exc_info=exc, extra=about)
                result = replace(held.final, outcome="failed", retryable=True,
                                 error=f"writing the video failed: {exc}")
            else:
                result = replace(held.final, video_key=video, thumbnail_key=thumb,
                                 has_audio=held.audio is not None)
                delay = 0.0
                log.info("stored: %s, %s", video, thumb, extra=about)
            with self._writes:
                current = held in self._held
                if current:
                    self._held.remove(held)
                    if self.send_stored is None:
                        self._stored.append(result)
                if result.outcome == "succeeded" or not self._held:
                    if self.store_error is not None:
                        log.info("rank %d: the storage takes the files again", self.rank)
                    self.store_error = None
                self._writes.notify_all()
            if current and self.send_stored is not None:
                self.send_stored([result])

    def _announced(self) -> _Held | None:
        """The oldest held job the writer may write (under ``_writes``)."""
        return next((h for h in self._held if h.announced), None)

    def _take_preview(self) -> None:
        """The running job's preview, for the preview thread in place of one it has not taken."""
        assert self.state is not None and self.ticket is not None
        self._last_preview = time.monotonic()
        try:
            frame = self.pipe.preview(self.state).numpy()
        except Exception:
            log.warning("rank %d: no preview of job %s", self.rank, self.ticket.job_id,
                        exc_info=True)
            return
        with self._writes:
            self._preview = _Preview(self.ticket.job_id, self.state.step_index,
                                     self.state.num_inference_steps, frame)
            self._writes.notify_all()

    def _store_previews(self) -> None:
        """The preview thread: stores the newest preview and deletes those of ended jobs
        (after any of theirs it was storing; on the way out, only that); a store that refuses
        either is logged (the first of a run of refused previews) and not retried."""
        # Both are there: __init__ starts this thread only when ``write`` has them.
        put = self.write.preview  # type: ignore[attr-defined]  # checked by hasattr
        drop = self.write.drop_preview  # type: ignore[attr-defined]  # checked by hasattr
        closing = refused = False
        while not closing:
            with self._writes:
                self._writes.wait_for(lambda: self._closing or self._preview is not None
                                      or bool(self._previews_ended))
                closing = self._closing
                preview, self._preview = None if closing else self._preview, None
                ended, self._previews_ended = self._previews_ended, []
            if preview is not None:
                try:
                    put(preview.frame, preview.job_id, preview.step, preview.num_inference_steps)
                except Exception as exc:
                    if not refused:
                        log.warning("rank %d: job %s's preview not stored: %s", self.rank,
                                    preview.job_id, _one_line(exc))
                    refused = True
                else:
                    if refused:
                        log.info("rank %d: previews are stored again", self.rank)
                    refused = False
            for job_id in ended:
                try:
                    drop(job_id)
                except Exception as exc:
                    log.warning("rank %d: job %s's preview not deleted: %s", self.rank, job_id,
                                _one_line(exc))

    def _discard(self, job_id: str | None) -> None:
        discard = getattr(self.write, "discard", None)
        if discard is not None and job_id is not None:
            discard(job_id)

    def close(self) -> None:
        """Stops the writer thread; jobs still held are given up (their attempts go back)."""
        with self._writes:
            self._closing = True
            given_up, self._held = self._held, []
            self._writes.notify_all()
        self._writer.join(timeout=CLOSE_WAIT_SECONDS)
        if self.preview_every_steps:
            self._previewer.join(timeout=CLOSE_WAIT_SECONDS)
        if self.checkpoints is not None and self.leads:
            self._checkpointer.join(timeout=CLOSE_WAIT_SECONDS)
        if given_up:
            log.warning("rank %d: leaving with %d job(s) whose files were not stored: %s",
                        self.rank, len(given_up), ", ".join(h.final.job_id for h in given_up))
        close = getattr(self.write, "close", None)
        if close is not None:
            close()
        self.pipe.close()

    def _job_id(self) -> str | None:
        return self.ticket.job_id if self.ticket else None

    def _end(self, job: _Job, *, keep_checkpoint: bool = False, **kwargs: Any) -> Ended:
        """Lets go of ``job``: its status with ``kwargs``; its preview and (unless kept for the
        next attempt) its checkpoint are deleted by their threads."""
        s = job.state
        status = Ended(rank=self.rank, job_id=job.ticket.job_id,
                       attempt_token=job.ticket.attempt_token, attempt=job.ticket.attempt,
                       step=s.step_index,
                       num_inference_steps=s.num_inference_steps,
                       compute_seconds=job.compute_seconds, gathers=job.gathers,
                       blocks_computed=job.blocks_computed, **kwargs)
        job_id = job.ticket.job_id
        if self.preview_every_steps:
            with self._writes:
                if self._preview is not None and self._preview.job_id == job_id:
                    self._preview = None
                self._previews_ended.append(job_id)
                self._writes.notify_all()
        if not keep_checkpoint:
            self._delete_checkpoints([job_id])
        if job in self.jobs:
            self.jobs.remove(job)
        if self.current is job:
            self.current = None
        return status

    def reported(self) -> None:
        """This turn's messages have reached rank 0: the checkpoints of the jobs whose step
        failed in it are deleted now (its driver records the failures), and the files of the
        jobs rendered in it are written."""
        failed, self._failed_steps = self._failed_steps, []
        self._delete_checkpoints(failed)
        with self._writes:
            if any(not h.announced for h in self._held):
                for h in self._held:
                    h.announced = True
                self._writes.notify_all()

    def _delete_checkpoints(self, job_ids: list[str]) -> None:
        """These jobs' checkpoints are not wanted any more: the checkpoint thread deletes them
        (and stores none of theirs that is still waiting)."""
        if not job_ids or self.checkpoints is None or not self.leads:
            return
        with self._writes:
            for job_id in job_ids:
                self._to_checkpoint.pop(job_id, None)
                self._checkpoints_ended.append(job_id)
            self._writes.notify_all()

    def progress(self, stepped: bool = True) -> list[Progress]:
        """Every held job's place after the turn (``stepped``: whether this rank computed in
        it)."""
        return [Progress(rank=self.rank, job_id=j.ticket.job_id,
                         attempt_token=j.ticket.attempt_token, step=j.state.step_index,
                         num_inference_steps=j.state.num_inference_steps,
                         compute_seconds=j.compute_seconds, resumed_from_step=j.resumed_from_step,
                         computed=stepped and j is self.current, lost_seconds=j.lost_seconds)
                for j in self.jobs]

    # Checkpoints of the jobs' denoising states.
    def _checkpoint_due(self, job: _Job) -> bool:
        if self.checkpoints is None or not self.leads:
            return False
        steps, seconds = self.checkpoint_every_steps, self.checkpoint_every_seconds
        return ((steps > 0 and job.state.step_index - job.checkpointed_step >= steps)
                or (seconds > 0 and time.monotonic() - job.checkpointed_at >= seconds))

    def _checkpoint(self, job: _Job) -> None:
        """Hands ``job``'s state to the checkpoint thread (in place of one it has not stored):
        the snapshot is taken here, at the step boundary; the store's write is not."""
        job.checkpointed_step, job.checkpointed_at = job.state.step_index, time.monotonic()
        try:
            blob = resume.snapshot(self.pipe, job.state, model_fingerprint=self.model_fingerprint)
        except Exception:
            log.warning("rank %d: no checkpoint of job %s", self.rank, job.ticket.job_id,
                        exc_info=True)
            return
        with self._writes:
            self._to_checkpoint[job.ticket.job_id] = blob
            self._writes.notify_all()

    def _checkpoint_now(self, job: _Job) -> None:
        """``job``'s state, stored before this returns (a hand-back: the next attempt, maybe on
        another group, must find this step). A store that refuses is logged: the job then
        resumes from its last checkpoint, or step 0."""
        if self.checkpoints is None or not self.leads:
            return
        job_id = job.ticket.job_id
        with self._writes:
            self._to_checkpoint.pop(job_id, None)
        try:
            blob = resume.snapshot(self.pipe, job.state, model_fingerprint=self.model_fingerprint)
            self.checkpoints.save(job_id, blob)
        except Exception as exc:
            log.warning("rank %d: job %s handed back without a checkpoint of step %d: %s",
                        self.rank, job_id, job.state.step_index, _one_line(exc))
        else:
            log.info("rank %d: job %s handed back with a checkpoint of step %d", self.rank,
                     job_id, job.state.step_index)

    def checkpoint_all(self) -> None:
        """Every held job's state, stored before this returns (the group is leaving)."""
        for job in self.jobs:
            self._checkpoint_now(job)

    def _store_checkpoints(self) -> None:
        """The checkpoint thread: stores the newest checkpoint of each job and deletes those of
        ended jobs; a store that refuses is logged and the checkpoint skipped (the next one, or
        the hand-back's, tries again): a checkpoint never fails its job."""
        assert self.checkpoints is not None
        while True:
            with self._writes:
                self._writes.wait_for(lambda: self._closing or bool(self._to_checkpoint)
                                      or bool(self._checkpoints_ended))
                if self._closing:
                    return
                ended, self._checkpoints_ended = self._checkpoints_ended, []
                pending = next(iter(self._to_checkpoint.items()), None)
                if pending is not None:
                    del self._to_checkpoint[pending[0]]
            if pending is not None:
                try:
                    self.checkpoints.save(*pending)
                except Exception as exc:
                    log.warning("rank %d: job %s's checkpoint not stored: %s", self.rank,
                                pending[0], _one_line(exc))
            for job_id in ended:
                try:
                    self.checkpoints.delete(job_id)
                except Exception as exc:
                    log.warning("rank %d: job %s's checkpoint not deleted: %s", self.rank,
                                job_id, _one_line(exc))

    def report(self, waiting: bool = False) -> RankReport:
        """This rank's own status for the turn: memory, whether it takes a new job, and the
        storage's error while its writes keep failing."""
        with self._writes:
            held, error = len(self._held), self.store_error
        return RankReport(rank=self.rank, memory=self.memory(), store_error=error,
                          takes_jobs=held < self.max_held_jobs, waiting=waiting)

    def memory(self) -> dict[str, Any]:
        free, total = self.platform.mem_get_info()
        pss, read_at = self._host_memory
        if time.monotonic() - read_at >= self.host_memory_every_seconds:
            _, pss, _ = memory_figures()
            self._host_memory = (pss, time.monotonic())
        return {"rank": self.rank, "replica": self.layout.replica(self.rank),
                "device": str(self.platform.device),
                "device_mem_used_bytes": total - free, "device_mem_total_bytes": total,
                "host_mem_bytes": pss, "cgroup_mem_bytes": cgroup_memory_bytes(),
                "job_id": self._job_id(), "pid": os.getpid(), **self.weight_figures(),
                **{f"step_{k}": v for k, v in self.pipe.last_step_figures.items()},
                **(self.adapters.figures() if self.adapters is not None else {})}

    def weight_figures(self) -> dict[str, int]:
        """The streamed transformers' figures, summed (`DLOHandle.weight_figures`); none for a
        pipeline that streams nothing."""
        out: dict[str, int] = {}
        for handle in self.pipe.handles:
            if handle is not None:
                for name, value in handle.weight_figures().items():
                    out[name] = out.get(name, 0) + value
        return out


def run_loop(rank: int, world: int, loop: RankLoop, driver: GroupDriver | None,
             stop_event: Any = None, *, own_pace: bool = False,
             peer_timeout_s: float | None = None) -> None:
    """Turns until the driver says stop. ``driver``: rank 0's (None on the other ranks);
    ``stop_event``: set when the group is asked to stop after its running jobs.

    ``own_pace``: where the pipeline gathers no weights across ranks (`VideoPipeline.
    gathers_weights` false on every rank), each replica steps at its own pace
    (`_own_pace_turns`); else, and without it, the group turns in lock-step. ``peer_timeout_s``:
    at its own pace, a rank that has not reported for this long fails the group (what the
    collectives' timeout does in lock-step)."""
    # Plans and messages are small Python objects: a gloo group carries them on every platform.
    control = dist.new_group(backend="gloo") if loop.platform.is_accelerator else dist.group.WORLD
    if own_pace:
        own_pace = world > 1 and _agree(not loop.pipe.gathers_weights, control)
    loop.own_pace = own_pace
    if driver is not None:
        driver.start(loop.memory(), own_pace=own_pace)
    failed = True
    try:
        if own_pace:
            _own_pace_turns(rank, loop, driver, stop_event, control, peer_timeout_s)
        else:
            _lockstep_turns(rank, world, loop, driver, stop_event, control)
        failed = False
    finally:
        if driver is not None:
            driver.stop(loop.memory(), failed=failed)
        loop.close()


# On a CPU host the ranks' compute shares the cores with the service around it: the API, the
# database, Redis, rank 0's coordinator and each rank's writer, which run briefly and for
# someone waiting (a submission, a claim, a final status). The thread that computes runs at
# this nice value at least (the threads it starts afterwards inherit it),
# so that those get a core when they wake rather than after the compute's time slice.
COMPUTE_NICENESS = 5


def _compute_at_lower_priority(loop: RankLoop) -> None:
    """`COMPUTE_NICENESS` for this (the computing) thread, on a CPU host only: an accelerator's
    compute does not hold a core, and the thread that launches it must not wait for one."""
    if loop.platform.is_accelerator or not hasattr(os, "setpriority"):
        return
    thread = threading.get_native_id()  # on Linux, a thread's own nice value
    try:
        now = os.getpriority(os.PRIO_PROCESS, thread)
        if now < COMPUTE_NICENESS:
            os.setpriority(os.PRIO_PROCESS, thread, COMPUTE_NICENESS)
    except OSError as exc:  # refused by the host: compute at the priority it has
        log.info("rank %d computes at its own priority: %s", loop.rank, exc)


def _agree(flag: bool, group: Any) -> bool:
    """True when ``flag`` is true on every rank of ``group``."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _lockstep_turns(rank: int, world: int, loop: RankLoop, driver: GroupDriver | None,
                    stop_event: Any, control: Any) -> None:
    """Every rank, every turn: rank 0's plan by broadcast, one step (or an idle one) of every
    rank, the messages gathered on rank 0."""
    _compute_at_lower_priority(loop)
    while True:
        plan_box: list[Any] = [None]
        if driver is not None:
            stop = bool(stop_event is not None and stop_event.is_set())
            plan_box[0] = driver.next_plan(stop)
        dist.broadcast_object_list(plan_box, src=0, group=control)
        plan: StepPlan = plan_box[0]
        if plan.stop:
            # The jobs still held go back to the queue when rank 0's driver stops: each
            # is checkpointed first, and every rank waits for the others' checkpoints.
            loop.checkpoint_all()
            dist.barrier(group=control)
            return
        messages: list[RankMessage] = list(loop.apply(plan))
        loop.interrupted = False
        if plan.step:
            # Every rank, in step: which transformers some rank's job runs this step (a
            # rank that sits the turn out needs none).
            active = agree_handles(loop.pipe, loop.state, group=control)
            if plan.leavable:
                # Rank 0's driver watches the queue, looked at until late in each block; the
                # group leaves inside a block too where a replica runs no collective within one.
                loop.pipe.leave_steps_when(
                    driver.leave_step if driver is not None else _never,
                    within_blocks=leaves_steps_part_way(loop.layout), late=driver is not None)
            try:
                ended = loop.step(active)
            finally:
                if plan.leavable:
                    loop.pipe.leave_steps_when(None)
            if ended is not None:
                messages.append(ended)
        # Files stored meanwhile; a turn without a step waits a little for them.
        messages.extend(loop.written(wait=0.0 if plan.step else WRITE_WAIT_SECONDS))
        if loop.leads:
            # A step the group left computed nothing kept.
            messages.extend(loop.progress(not loop.interrupted))
        messages.append(loop.report())
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(messages, gathered if rank == 0 else None, dst=0, group=control)
        loop.reported()
        if driver is not None:
            driver.record([st for per_rank in gathered for st in per_rank])


def _never() -> bool:
    return False


def _own_pace_turns(rank: int, loop: RankLoop, driver: GroupDriver | None, stop_event: Any,
                    control: Any, peer_timeout_s: float | None) -> None:
    """Every rank steps its replica's job as fast as it goes, with no collective between
    replicas: the orders for the replica come from its queue in the mailbox (between two steps,
    without waiting while it has a job), and the rank's messages go to rank 0's after every
    step. Rank 0's `_Conductor` thread turns the driver's plans into each replica's orders and
    hands it the messages. A replica of several ranks (sp > 1) stays in step within itself: its
    first rank broadcasts the orders it took to the others on the replica's own group."""
    layout = loop.layout
    mailbox = open_mailbox(rank, control)
    interrupt = _Interrupt(loop, mailbox) if leaves_steps_part_way(layout) else None
    # A job's final status goes out from the writer thread as soon as its files are stored.
    loop.send_stored = mailbox.clone().report
    replica_group = _replica_group(rank, layout)
    conductor = None
    if driver is not None:
        conductor = _Conductor(driver, mailbox.clone(), layout, stop_event, peer_timeout_s)
        conductor.start()
    _compute_at_lower_priority(loop)  # after the conductor's start: it keeps the priority
    hold_until: float | None = None  # the leader's, while on a hold: when it lapses
    paused = False  # on a `StepPlan.pause`, until orders name a job to run
    try:
        while True:
            if conductor is not None and conductor.error is not None:
                raise RuntimeError("the group's coordinator failed") from conductor.error
            orders: list[StepPlan] = []
            holding = False
            if loop.leads:
                # On a hold the replica takes no step until its orders come or the hold lapses.
                left = None if hold_until is None else hold_until - time.monotonic()
                wait = (IDLE_REPORT_SECONDS if not loop.jobs or paused
                        else 0.0 if left is None else max(0.0, left))
                # Orders an interrupted step took first, then any that came since.
                orders = interrupt.take() if interrupt is not None else []
                orders += mailbox.orders(loop.slot, wait=0.0 if orders else wait)
                if any(loop.slot in plan.hold for plan in orders):
                    hold_until = time.monotonic() + HOLD_SECONDS
                elif orders or (hold_until is not None and time.monotonic() >= hold_until):
                    hold_until = None
                holding = hold_until is not None
            if replica_group is not None:
                box: list[Any] = [(orders, holding)]
                dist.broadcast_object_list(box, src=loop.slot, group=replica_group)
                orders, holding = box[0]
            messages: list[RankMessage] = []
            if any(plan.stop for plan in orders):
                loop.checkpoint_all()
                break
            for plan in orders:
                messages.extend(loop.apply(plan))
                paused = _paused_by(plan, loop.slot, paused)
            if loop.current is None:
                loop.pick()
            stepped = loop.current is not None and not holding and not paused
            if stepped:
                assert loop.state is not None and loop.current is not None
                if interrupt is not None:
                    interrupt.arm(loop.current.ticket)
                try:
                    ended = loop.step(loop.pipe.handles_needed(loop.state))
                finally:
                    if interrupt is not None:
                        interrupt.disarm()
                if ended is not None:
                    messages.append(ended)
                stepped = not loop.interrupted  # a step left part-way computed nothing kept
            if loop.leads:
                messages.extend(loop.progress(stepped))
            messages.append(loop.report(waiting=holding or (paused and bool(loop.jobs))))
            mailbox.report(messages)
            loop.reported()
    finally:
        if interrupt is not None:
            interrupt.close()
        if conductor is not None:
            conductor.close()
    # Every replica has checkpointed what it held before rank 0's driver hands it back.
    dist.barrier(group=control)
    if conductor is not None and conductor.error is not None:
        raise RuntimeError("the group's coordinator failed") from conductor.error


def _paused_by(plan: StepPlan, slot: int, paused: bool) -> bool:
    """Whether replica ``slot`` sits out after ``plan`` (it was: ``paused``): from a
    `StepPlan.pause` naming it until orders name a job for it to run."""
    if slot in plan.pause:
        return True
    if slot in (plan.run or {}) or slot in plan.assign:
        return False
    return paused


def leaves_steps_part_way(layout: Layout) -> bool:
    """Whether the replicas of ``layout``, at their own pace, leave a step part-way for orders
    that want them (`_Interrupt`): replicas of one rank do; the ranks of a larger replica run
    collectives within it, so they keep to step boundaries."""
    return layout.sp == 1


class _Interrupt:
    """Where a replica of one rank at its own pace looks at its orders in the middle of a step:
    as each block of its transformers, and each module inside one, is about to run (at most
    every ``LOOK_SECONDS``). Orders that want the replica now (a hold for another job, a job to
    take, a cancel or a hand-back of the job it computes, the stop) end the step there
    (`StepInterrupted`): an interactive job then waits for one layer of a batch job's step,
    not the whole step (a 256x256x33 kiln-tiny step takes 0.5 s on one core; its
    self-attention, 77 ms, runs in slices that are modules too: `runtime.models.tiny.
    SlicedAttention`, so no stretch between two looks is longer than about 10 ms). The blocks
    the step had computed are
    kept and given back when it is taken again (`runtime.step_replay`): a preemption loses at
    most the block it came inside (a caching job's, the whole step). The orders wait in
    ``pending`` for the loop. The job's state is as before the step (`VideoPipeline.step`: a
    caching job's step cache too)."""

    LOOK_SECONDS = 0.005  # a look costs a round trip to the store: tens of microseconds

    def __init__(self, loop: RankLoop, mailbox: Mailbox) -> None:
        self.loop = loop
        self.mailbox = mailbox
        self.pending: list[StepPlan] = []
        self._job_id: str | None = None  # the job whose step may be left now; None: no step
        self._looked = 0.0
        # Before the engine's own hooks (prepend): a block is left before it is fetched.
        self._hooks = [module.register_forward_pre_hook(self._look, prepend=True)
                       for handle in loop.pipe.handles if handle is not None
                       for block in handle.block_modules for module in block.modules()]

    def arm(self, ticket: Ticket) -> None:
        """``ticket``'s job steps now: its step may be left part-way, keeping the blocks it
        computed (`VideoPipeline.keep_left_blocks`)."""
        self._job_id = ticket.job_id
        self._looked = time.monotonic()
        self.loop.pipe.keep_left_blocks(True)

    def disarm(self) -> None:
        self._job_id = None
        self.loop.pipe.keep_left_blocks(False)

    def take(self) -> list[StepPlan]:
        """The orders a look took, oldest first, for the loop to apply."""
        pending, self.pending = self.pending, []
        return pending

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _look(self, module: Any, args: Any) -> None:
        if self._job_id is None or time.monotonic() - self._looked < self.LOOK_SECONDS:
            return
        orders = self.mailbox.orders(self.loop.slot)
        self._looked = time.monotonic()
        if not orders:
            return
        self.pending.extend(orders)
        if any(self._wants_replica(plan) for plan in orders):
            self._job_id = None
            raise StepInterrupted

    def _wants_replica(self, plan: StepPlan) -> bool:
        slot = self.loop.slot
        return (plan.stop or slot in plan.hold or slot in plan.pause or slot in plan.assign
                or self._job_id in plan.drop or self._job_id in plan.hand_back)


# How long a rank at its own pace without a job waits for orders before it reports itself all
# the same: rank 0 hears from every rank at least this often.
IDLE_REPORT_SECONDS = 0.5
# The longest a replica on a hold (`StepPlan.hold`) waits for its orders before it goes on with
# its job by itself (the job it was held for went elsewhere).
HOLD_SECONDS = 0.5


def _replica_group(rank: int, layout: Layout) -> Any:
    """The gloo group of this rank's replica, when it has more than one rank (every rank
    creates every replica's group, in the same order)."""
    if layout.sp == 1:
        return None
    mine = None
    for replica in range(layout.dp):
        ranks = layout.ranks(replica)
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = group
    return mine


class _Conductor:
    """Rank 0's thread while the replicas keep their own pace: the driver's plans, split into
    each replica's orders; the ranks' messages, handed to the driver as they come. A rank that
    has not reported for ``peer_timeout_s`` is lost: the thread fails, and so does the group."""

    def __init__(self, driver: GroupDriver, mailbox: Mailbox, layout: Layout, stop_event: Any,
                 peer_timeout_s: float | None) -> None:
        self.driver = driver
        self.mailbox = mailbox
        self.layout = layout
        self.stop_event = stop_event
        self.peer_timeout_s = peer_timeout_s
        self.error: BaseException | None = None
        self._closing = threading.Event()
        self._ran: dict[int, str] = {}  # replica -> the job its last orders named to run
        self._paused: set[int] = set()  # replicas told to sit out (`StepPlan.pause`)
        self._heard = dict.fromkeys(range(layout.world), time.monotonic())
        self._thread = threading.Thread(target=self._run, daemon=True, name="kiln-conductor")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Ends the thread (it has sent the stop, or the rank is failing) and waits for it."""
        self._closing.set()
        self._thread.join(timeout=CLOSE_WAIT_SECONDS + 30)

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                stop = bool(self.stop_event is not None and self.stop_event.is_set())
                plan = self.driver.next_plan(stop)
                self._send(plan)
                if plan.stop:
                    return
                messages = self.mailbox.reports(wait=REPORT_WAIT_SECONDS)
                self._check_peers(messages)
                self.driver.record(messages)
        except BaseException as exc:  # noqa: BLE001 - rank 0's loop raises it
            log.exception("the group's coordinator failed")
            self.error = exc

    def _send(self, plan: StepPlan) -> None:
        """Each replica's part of ``plan``: its new job, the job to run when that changes, and
        the drops, hand-backs and abandons (a replica ignores the jobs it does not hold)."""
        for replica in self.layout.leaders:
            part = StepPlan(drop=plan.drop, hand_back=plan.hand_back, abandon=plan.abandon,
                            stop=plan.stop, hold=[replica] if replica in plan.hold else [])
            ticket = plan.assign.get(replica)
            if ticket is not None:
                part.assign = {replica: ticket}
                self._ran.pop(replica, None)  # the replica runs its new job first
                self._paused.discard(replica)
            if replica in plan.pause and replica not in self._paused and ticket is None:
                part.pause = [replica]
                self._paused.add(replica)
                self._ran.pop(replica, None)  # named again when it is to run
            run = plan.run.get(replica) if plan.run is not None else None
            if run is not None and run != self._ran.get(replica):
                part.run = {replica: run}
                self._ran[replica] = run
                self._paused.discard(replica)
            if (part.assign or part.run or part.drop or part.hand_back or part.abandon
                    or part.hold or part.pause or part.stop):
                self.mailbox.send(replica, [part])

    def _check_peers(self, messages: list[RankMessage]) -> None:
        now = time.monotonic()
        for m in messages:
            self._heard[m.rank] = now
        if self.peer_timeout_s is None:
            return
        silent = {r: now - t for r, t in self._heard.items() if now - t > self.peer_timeout_s}
        if silent:
            r = min(silent)
            raise RuntimeError(f"rank {r} has not reported for {silent[r]:.0f} s: lost")


# The longest rank 0's coordinator waits for the ranks' messages before it plans again: while
# every replica runs a long batch step, how late it may see an interactive job that is due and
# claim it for a replica to preempt (a plan then costs one look at the queue in Redis). At
# 0.05 s that was a third of the overnight scenario's slowest interactive waits.
REPORT_WAIT_SECONDS = 0.02


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
