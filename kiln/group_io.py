"""What the worker group's coordinator asks of the servers, behind one interface.

`GroupIO` is every call rank 0's `kiln.coordinator.Coordinator` makes outside its own memory:
claims and the queue's wake-ups, heartbeats, the ends of attempts, job events, learned costs,
the group's report and the live webhooks. `ServerIO` makes those calls against PostgreSQL (or
SQLite), Redis and the webhook queue; the coordinator's tests hand in one that keeps everything
in memory. A call whose server is out raises that server's own error
(`storage.outages.is_outage` tells an outage apart); what an outage means for the group is the
coordinator's decision, not this module's.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from redis import Redis, RedisError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from common.families import family_of
from common.quality import tier_threshold
from common.settings import Settings
from runtime.adapter_cache import AdapterRef
from runtime.pipelines.base import Conditioning, VideoRequest
from runtime.rank_loop import Ticket
from scheduler import queue_index
from scheduler.attempts import Ending, finish_attempt
from scheduler.claim import claim_for_group, job_tokens, load_costs, record_result
from scheduler.cost import CostModel
from scheduler.policy import INTERACTIVE, RunningJob
from storage import lifecycle, media, queries
from storage.db import make_engine, make_session_factory
from storage.lifecycle import Beat
from storage.outages import describe, is_outage
from storage.outputs import OutputStore, make_store
from storage.tables import InputFile, Job, LoraAdapter
from storage.webhooks import LIVE_EVENTS
from storage.workers import GroupReport, report_group

if TYPE_CHECKING:
    from celery import Celery  # loaded on rank 0 only, by ServerIO

log = logging.getLogger(__name__)

# A job that asked for job.progress gets one at most this often (kept in memory on rank 0).
PROGRESS_EVERY_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Claimed:
    """A job the group has just claimed for one of its replicas."""

    replica: int  # the replica's first rank
    ticket: Ticket
    job_class: str
    model: str
    tokens: int  # its token count, for the cost model's estimate of a step
    attempt: int  # its attempt number (1 for a first claim)


@dataclass(frozen=True, slots=True)
class Attempt:
    """An attempt the database says runs under this group's id."""

    job_id: str
    token: str
    attempt: int
    rank: int | None


# What a job's event records: its step when it was suspended, continued or resumed.
NOTES: dict[str, Callable[..., object]] = {
    "preempted": lifecycle.note_preempted, "continued": lifecycle.note_continued,
    "resumed": lifecycle.note_resumed}


class GroupIO(Protocol):
    """The coordinator's calls to the servers; each raises its server's error while it is out."""

    def claim(self, free: Sequence[int], running: Sequence[RunningJob], *, prefer: str,
              job_class: str | None) -> list[Claimed]:
        """Queued jobs claimed for the ``free`` replicas (``job_class``: that class only)."""

    def interactive_due(self) -> bool:
        """Whether an interactive job for this group's model is due in the queue."""

    def wait_for_work(self, seconds: float) -> None:
        """Up to ``seconds``, cut short when a submission announces work."""

    def costs(self) -> CostModel:
        """The learned cost model of the group's layout."""

    def heartbeat(self, job_id: str, token: str, *, step: int | None = None,
                  num_inference_steps: int | None = None) -> Beat | None:
        """Renews the attempt's lease (and records its step); None if it is not current."""

    def finish(self, job_id: str, token: str, ending: Ending) -> str | None:
        """Ends the attempt; the job's state after it, or None if the attempt was not current."""

    def note(self, event: str, job_id: str, token: str, **fields: Any) -> None:
        """A job's event beside its render: ``preempted``, ``continued`` or ``resumed``."""

    def learn_cost(self, job_id: str, num_inference_steps: int, compute_seconds: float) -> None:
        """Teaches the cost model a finished job's own step time (best effort)."""

    def report(self, report: GroupReport) -> None:
        """Records the group's state for ``/v1/workers``."""

    def attempts(self) -> list[Attempt]:
        """The attempts the database holds as running under this group's id."""

    def progress(self, job_id: str, attempt: int | None, step: int, steps: int) -> None:
        """job.progress for a job that asked for it, at most every PROGRESS_EVERY_SECONDS."""

    def forget(self, job_id: str) -> None:
        """The job's attempt here is over: no more live events for it."""

    def close(self) -> None:
        """Closes the connections."""


class ServerIO:
    """`GroupIO` against the servers of ``settings``: the database, Redis, the webhook queue.

    ``notify(session, job_id)``: called after a job's final state is committed (default: the
    webhook enqueue, `kiln.tasks.enqueue_job_finished`, on a Celery app of ``settings``);
    ``report(session, report)``: records the group's state; ``send_event(url, msg_id, kind,
    body)``: enqueues a live webhook (default: `kiln.tasks.enqueue_event`, on that app).
    """

    def __init__(self, settings: Settings, *, group_id: str, model: str, sp: int,
                 notify: Callable[[Session, str], object] | None = None,
                 report: Callable[[Session, GroupReport], object] = report_group,
                 send_event: Callable[[str, str, str, bytes], object] | None = None) -> None:
        if not settings.redis_url:
            raise ValueError("the worker needs REDIS_URL (kiln up sets it for its children)")
        self._celery: Celery | None = None
        if notify is None or send_event is None:
            # Here, not at the top: Celery (20 MiB a process) loads on rank 0 only, the one
            # rank that enqueues webhooks.
            from kiln.tasks import enqueue_event, enqueue_job_finished, make_celery

            self._celery = celery = make_celery(settings)
            notify = notify or functools.partial(enqueue_job_finished, celery)
            send_event = send_event or functools.partial(enqueue_event, celery)
        self.settings = settings
        self.prefix = settings.redis_prefix
        self.group_id = group_id
        self.model = model
        self.sp = sp
        self.notify = notify
        self.send_event = send_event
        self._report = report
        self.sessions = make_session_factory(make_engine(settings.database_url))
        self.redis = Redis.from_url(settings.redis_url)
        # The live webhooks of the jobs that asked for them: job id -> (url, events), known
        # from their claim; and when each last had a job.progress (monotonic).
        self.live_hooks: dict[str, tuple[str, frozenset[str]]] = {}
        self._last_progress: dict[str, float] = {}
        self.store: OutputStore | None = None  # where input files are read, made when needed

    # The queue.
    def claim(self, free: Sequence[int], running: Sequence[RunningJob], *, prefer: str,
              job_class: str | None) -> list[Claimed]:
        with self.sessions() as session:
            claims = claim_for_group(
                session, self.redis, prefix=self.prefix, group_id=self.group_id,
                model=self.model, free_ranks=free, running=running,
                lease_seconds=self.settings.lease_seconds, sp=self.sp, prefer=prefer,
                job_class=job_class)
        out = []
        for replica, claim in claims:
            job = claim.job
            try:
                request = VideoRequest.of(job, conditioning=self._conditioning(job))
            except media.Rejected as exc:
                # The request's own input is gone or unreadable: no attempt would fare better.
                log.warning("job %s: its input cannot be read: %s", job.id, exc)
                self.finish(job.id, claim.attempt_token, Ending(
                    outcome="failed", error=f"the input file cannot be read: {exc}",
                    code="input_unavailable"))
                continue
            try:
                adapters = self._adapters(job)
            except LookupError as exc:  # deleted after the job was submitted
                log.warning("job %s: %s", job.id, exc)
                self.finish(job.id, claim.attempt_token, Ending(
                    outcome="failed", error=str(exc), code="adapter_unavailable"))
                continue
            request = dataclasses.replace(request, step_cache=self._step_cache(job))
            claimed = Claimed(replica=replica, job_class=job.class_, model=job.model,
                              tokens=job_tokens(job), attempt=job.attempts,
                              ticket=Ticket(job_id=job.id, attempt_token=claim.attempt_token,
                                            attempt=job.attempts,
                                            request=request, audio=job.audio is not False,
                                            adapters=adapters))
            out.append(claimed)
            self.started(job)
        return out

    def _adapters(self, job: Job) -> tuple[AdapterRef, ...]:
        """Where each rank of the replica reads the job's adapters, and their scales (the bytes
        stay off the mailbox); `LookupError` for one deleted since the job was submitted."""
        if not job.adapters:
            return ()
        with self.sessions() as session:
            rows = {row.id: row for row in session.scalars(select(LoraAdapter).where(
                LoraAdapter.id.in_([a["id"] for a in job.adapters])))}
        refs = []
        for item in job.adapters:
            row = rows.get(item["id"])
            if row is None:
                raise LookupError(f"adapter {item['id']} was deleted before the job ran")
            refs.append(AdapterRef(key=row.storage_key, sha256=row.sha256,
                                   scale=float(item["scale"]), name=row.name))
        return tuple(refs)

    def _step_cache(self, job: Job) -> float | None:
        """The first-block cache threshold of the job's quality tier (None: exact). A replica
        of several ranks caches no step (its split forward has no cache), so there the job
        renders exact, and says so in the log."""
        if job.quality in (None, "exact"):
            return None
        if self.sp > 1:
            log.info("job %s: quality %s renders exact at sp=%d", job.id, job.quality, self.sp)
            return None
        return tier_threshold(family_of(job.model).name, job.quality)

    def _conditioning(self, job: Job) -> Conditioning | None:
        """The pixels ``job`` starts from, fitted to its size (None: text only); `Rejected`
        when its input file was deleted or no longer decodes. Read whole before decoding: an
        object store's stream does not seek."""
        if job.input_fit is None and job.input_file_id is None:
            return None
        with self.sessions() as session:
            row = (session.get(InputFile, job.input_file_id)
                   if job.input_file_id is not None else None)
            if row is None:
                raise media.Rejected("missing", "it was deleted before the job ran")
            kind, key = row.kind, row.storage_key
        if self.store is None:
            self.store = make_store(self.settings)
        try:
            with self.store.open(key) as stored:
                data = io.BytesIO(stored.read())
        except OSError as exc:
            raise media.Rejected("missing", f"the stored object cannot be read: {exc}") from exc
        extend = job.input_role == "extend"
        fit = cast(media.FitMode, job.input_fit or "crop")  # checked on submit
        frames = media.fitted_frames(data, kind, media.Limits.of(self.settings), job.width,
                                     job.height, fit, max_frames=None if extend else job.num_frames)
        pixels = torch.from_numpy(np.stack([np.asarray(frame) for frame in frames]))
        if extend:  # rendered from the clip's last frame, stored after the clip
            return Conditioning(image=pixels[-1], prefix=pixels)
        if kind == "image":
            return Conditioning(image=pixels[0])
        if len(pixels) < job.num_frames:  # a shorter clip holds its last frame to the length
            pixels = torch.cat([pixels, pixels[-1:].expand(job.num_frames - len(pixels),
                                                           -1, -1, -1)])
        return Conditioning(video=pixels, strength=job.strength)

    def interactive_due(self) -> bool:
        return queue_index.has_due(self.redis, self.prefix, self.model, INTERACTIVE, time.time())

    def wait_for_work(self, seconds: float) -> None:
        try:
            queue_index.wait_for_work(self.redis, self.prefix, seconds)
        except RedisError:
            time.sleep(seconds)  # the claim that follows reports the outage

    def costs(self) -> CostModel:
        """The learned costs of this group's layout; the default guess while Redis is out."""
        try:
            return load_costs(self.redis, self.prefix, self.sp)
        except RedisError:
            return CostModel(sp=self.sp)

    # The attempts.
    def heartbeat(self, job_id: str, token: str, *, step: int | None = None,
                  num_inference_steps: int | None = None) -> Beat | None:
        with self.sessions() as session:
            return lifecycle.heartbeat(session, job_id, token, step=step,
                                       num_inference_steps=num_inference_steps,
                                       lease_seconds=self.settings.lease_seconds)

    def finish(self, job_id: str, token: str, ending: Ending) -> str | None:
        # The webhook goes out after the commit rather than at the next sweep (best effort:
        # ``notify`` never raises).
        with self.sessions() as session:
            return finish_attempt(session, self.redis, self.prefix, job_id, token, ending,
                                  notify=self.notify)

    def note(self, event: str, job_id: str, token: str, **fields: Any) -> None:
        with self.sessions() as session:
            NOTES[event](session, job_id, token, **fields)

    def learn_cost(self, job_id: str, num_inference_steps: int, compute_seconds: float) -> None:
        """At this group's layout: a step split over sp ranks costs otherwise than one on a
        single rank."""
        try:
            with self.sessions() as session:
                job = session.get(Job, job_id)
        except SQLAlchemyError as exc:  # best effort: the next jobs teach the cost as well
            log.warning("could not learn the cost of job %s: %s", job_id,
                        describe(exc) if is_outage(exc) else repr(exc))
            return
        if job is None:
            return
        try:
            record_result(self.redis, prefix=self.prefix, job_id=job.id, model=job.model,
                          num_tokens=job_tokens(job), num_inference_steps=num_inference_steps,
                          render_seconds=compute_seconds, sp=self.sp)
        except RedisError:
            log.warning("could not record the cost of job %s", job.id, exc_info=True)

    def report(self, report: GroupReport) -> None:
        with self.sessions() as session:
            self._report(session, report)

    def attempts(self) -> list[Attempt]:
        with self.sessions() as session:
            rows = queries.running_jobs_by_group(session, [self.group_id])
            return [Attempt(job_id=job.id, token=job.attempt_token, attempt=job.attempts,
                            rank=job.rank)
                    for job in rows.get(self.group_id, []) if job.attempt_token is not None]

    # Live webhooks.
    def started(self, job: Job) -> None:
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

    def progress(self, job_id: str, attempt: int | None, step: int, steps: int) -> None:
        hook = self.live_hooks.get(job_id)
        if hook is None or "job.progress" not in hook[1]:
            return
        now = time.monotonic()
        last = self._last_progress.get(job_id)
        if last is not None and now - last < PROGRESS_EVERY_SECONDS:
            return
        from kiln.tasks import progress_event  # here: Celery loads on rank 0 only

        self._last_progress[job_id] = now
        msg_id, body = progress_event(job_id, attempt, step, steps)
        self.send_event(hook[0], msg_id, "job.progress", body)

    def forget(self, job_id: str) -> None:
        self.live_hooks.pop(job_id, None)
        self._last_progress.pop(job_id, None)

    def close(self) -> None:
        self.redis.close()
        if self._celery is not None:
            self._celery.close()
        self.sessions.kw["bind"].dispose()
