"""How an attempt ends: one guarded transition in the database, then what follows it.

`finish_attempt` serves every end of an attempt a worker group sees: a rank's job succeeded,
was cancelled or failed, and the group's give-back on its way out. The lease reaper ends the
attempts whose group vanished with one set-based transition of its own (`storage.lifecycle.reap`)
and hands what it did to `settle`, the part every end shares: after the commit, a job back in
`queued` goes back into the queue index, and a job that reached a final state is announced
(``notify``, the webhook enqueue).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from redis import Redis, RedisError
from sqlalchemy.orm import Session

from scheduler import queue_index
from storage import lifecycle
from storage.tables import TERMINAL_STATES, Job, JobState

log = logging.getLogger(__name__)

Notify = Callable[[Session, str], object]


@dataclass(frozen=True, kw_only=True, slots=True)
class Ending:
    """How an attempt ended, as the worker saw it."""

    outcome: Literal["succeeded", "cancelled", "failed"]
    video_key: str | None = None  # succeeded: the stored video and thumbnail
    thumbnail_key: str | None = None
    has_audio: bool | None = None  # succeeded: whether the video has a soundtrack
    # succeeded: what its steps cost (`storage.tables.Job.gathers`, ``blocks_computed``)
    gathers: int | None = None
    blocks_computed: int | None = None
    error: str | None = None  # failed: the reason a person can act on
    code: str = "render_failed"
    retryable: bool = False  # the worker, not the request, was at fault: the job may run again
    # False: the job did not cause this end (its group stopped or drained): handed back
    # without spending one of its attempts.
    charged: bool = True


def finish_attempt(session: Session, redis: Redis, prefix: str, job_id: str,
                   attempt_token: str, ending: Ending, *,
                   notify: Notify | None = None) -> JobState | None:
    """Ends attempt ``attempt_token`` of job ``job_id`` as ``ending`` says (one guarded UPDATE
    and its event, committed), then `settle`s it. Returns the job's new state, or None if the
    attempt was no longer current (nothing was written)."""
    state: JobState | None
    if ending.outcome == "succeeded":
        assert ending.video_key is not None
        done = lifecycle.finish_succeeded(session, job_id, attempt_token,
                                          video_key=ending.video_key,
                                          thumbnail_key=ending.thumbnail_key,
                                          has_audio=ending.has_audio,
                                          gathers=ending.gathers,
                                          blocks_computed=ending.blocks_computed)
        state = JobState.SUCCEEDED if done else None
    elif ending.outcome == "cancelled":
        done = lifecycle.finish_cancelled(session, job_id, attempt_token)
        state = JobState.CANCELLED if done else None
    else:
        state = lifecycle.fail_job(session, job_id, attempt_token,
                                   error=ending.error or "render failed", code=ending.code,
                                   retryable=ending.retryable, charged=ending.charged)
    requeued: list[Job] = []
    if state == JobState.QUEUED and (job := session.get(Job, job_id)) is not None:
        requeued.append(job)
    finished = [job_id] if state in TERMINAL_STATES else []
    settle(session, redis, prefix, requeued=requeued, finished=finished, notify=notify)
    return state


def settle(session: Session, redis: Redis, prefix: str, *, requeued: Sequence[Job],
           finished: Sequence[str], notify: Notify | None = None) -> None:
    """After a committed transition: ``requeued`` jobs back into the queue index, ``notify``
    for each ``finished`` one. A Redis outage loses nothing: the rows are queued, and the next
    reconcile (`scheduler.queue_index.reconcile`) indexes them."""
    if requeued:
        try:
            queue_index.add(redis, prefix, requeued)
        except RedisError:
            log.warning("Redis unavailable; %d requeued job(s) wait for the next reconcile",
                        len(requeued), exc_info=True)
    if notify is not None:
        for job_id in finished:
            notify(session, job_id)
