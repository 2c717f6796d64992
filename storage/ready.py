"""The Redis ready index: which queued jobs a batcher may look at, in priority order.

The database is the truth; this index only saves the batcher from scanning it. Losing it loses
nothing: `rebuild_ready_index` puts back every queued job. A stale entry (a job no longer queued)
is harmless because `storage.jobs.claim_job` refuses it; the claimer just removes it.

Layout (``P`` is ``Settings.redis_prefix``, ``kiln:`` by default): one sorted set per class and
priority, ``P + "ready:{class}:{priority}"``, e.g. ``kiln:ready:interactive:9``. Members are job
ids; the score is the Unix time from which the job may run (its ``not_before``, else its creation
time), so ``ZRANGEBYSCORE key -inf <now>`` yields the due jobs oldest first. `ready_keys` lists
the 20 keys in the order they should be served: interactive 9..0, then batch 9..0.

`add` also appends each id to the list ``P + "ready:new"`` (the newest ``NEW_CAP`` kept), from
which the batcher's per-user index (``scheduler.index``) learns of new entries without scanning,
and one token to ``P + "ready:wake"`` (at most ``WAKE_CAP`` kept): an idle worker group blocks on
that list (`wait_for_work`) instead of sleeping between looks, so a job submitted to an idle group
starts within a Redis round trip. A lost or extra token costs nothing but a look: the groups
still look on their own every poll interval.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import NoScriptError
from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.jobs import MAX_PRIORITY, MIN_PRIORITY
from storage.models import Job, JobClass, JobState

_CHUNK = 1000
# Ids announced to the batcher but not yet taken; beyond this the oldest are dropped (the
# batcher's periodic reconcile finds those jobs in the database instead).
NEW_CAP = 100_000
# Wake tokens kept for idle worker groups: enough to wake every group of a large deployment for
# a burst of submissions, few enough that a backlog of them makes only a few needless looks.
WAKE_CAP = 64


def ready_key(prefix: str, job_class: str, priority: int) -> str:
    return f"{prefix}ready:{job_class}:{priority}"


def new_key(prefix: str) -> str:
    return f"{prefix}ready:new"


def wake_key(prefix: str) -> str:
    return f"{prefix}ready:wake"


def ready_keys(prefix: str) -> list[str]:
    """Every ready key, in the order a batcher should serve them."""
    return [
        ready_key(prefix, cls.value, p)
        for cls in (JobClass.INTERACTIVE, JobClass.BATCH)
        for p in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1)
    ]


def score(job: Job) -> float:
    due = job.not_before if job.not_before is not None else job.created_at
    return max(due, job.created_at).timestamp()


def add(redis: Redis, prefix: str, jobs: Iterable[Job]) -> None:
    """Adds queued jobs (call only after the transaction that queued them has committed)."""
    pipe = redis.pipeline(transaction=False)
    if _announce(pipe, prefix, jobs):
        pipe.execute()


def _announce(pipe: Pipeline, prefix: str, jobs: Iterable[Job]) -> bool:
    """Queues `add`'s commands on ``pipe``; False if there were no jobs."""
    ids = []
    for job in jobs:
        pipe.zadd(ready_key(prefix, job.class_, job.priority), {job.id: score(job)})
        ids.append(job.id)
    if ids:
        pipe.rpush(new_key(prefix), *ids)
        pipe.ltrim(new_key(prefix), -NEW_CAP, -1)
        pipe.rpush(wake_key(prefix), "1")
        pipe.ltrim(wake_key(prefix), -WAKE_CAP, -1)
    return bool(ids)


def wait_for_work(redis: Redis, prefix: str, timeout_seconds: float) -> bool:
    """Blocks until `add` announces new work or ``timeout_seconds`` pass; True if it did."""
    # BLPOP's timeout is in seconds (fractions allowed); 0 would mean "forever".
    return redis.blpop([wake_key(prefix)], timeout=max(timeout_seconds, 0.001)) is not None


def remove(redis: Redis, prefix: str, job: Job) -> None:
    redis.zrem(ready_key(prefix, job.class_, job.priority), job.id)


# KEYS: the ready keys served before the job's, then its own; ARGV[1]: the job id. One command
# instead of a ZCARD per key ahead (up to 19) and a ZRANK: every submit response asks for it.
_POSITION = """
local ahead = 0
for i = 1, #KEYS - 1 do
  ahead = ahead + redis.call('ZCARD', KEYS[i])
end
local rank = redis.call('ZRANK', KEYS[#KEYS], ARGV[1])
if not rank then
  return -1
end
return ahead + rank
"""


@functools.cache
def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _keys_up_to(prefix: str, job: Job) -> list[str]:
    """The ready keys served before ``job``'s, then its own."""
    mine = ready_key(prefix, job.class_, job.priority)
    keys = ready_keys(prefix)
    return [*keys[: keys.index(mine)], mine]


def position(redis: Redis, prefix: str, job: Job) -> int | None:
    """Entries ahead of ``job`` in serving order, from the index in O(log n); None if the job is
    not in the index (not queued, or the index is being rebuilt)."""
    keys = _keys_up_to(prefix, job)
    try:
        found = redis.evalsha(_sha(_POSITION), len(keys), *keys, job.id)
    except NoScriptError:  # the first call after Redis started (or flushed its scripts)
        found = redis.eval(_POSITION, len(keys), *keys, job.id)
    return None if int(found) < 0 else int(found)


def add_one(redis: Redis, prefix: str, job: Job) -> int | None:
    """`add` for one job, and its `position`, in one round trip (what every submit does)."""
    pipe = redis.pipeline(transaction=False)
    _announce(pipe, prefix, [job])
    keys = _keys_up_to(prefix, job)
    pipe.evalsha(_sha(_POSITION), len(keys), *keys, job.id)
    *added, found = pipe.execute(raise_on_error=False)
    for reply in [*added, found]:
        if isinstance(reply, Exception) and not isinstance(reply, NoScriptError):
            raise reply
    if isinstance(found, NoScriptError):  # the job is added; only the position needs the script
        return position(redis, prefix, job)
    return None if int(found) < 0 else int(found)


@dataclass(frozen=True, slots=True)
class Rebuilt:
    added: int  # queued jobs written (already-present ones count too: ZADD is idempotent)
    removed: int  # entries whose job is no longer queued


def rebuild_ready_index(session: Session, redis: Redis, prefix: str) -> Rebuilt:
    """Makes the index hold every queued job, and drops entries for jobs that are not queued.

    Safe to run while the API submits and batchers claim: it only adds jobs the database says are
    queued, and removes an entry only after re-reading that job's state.
    """
    queued: set[str] = set()
    added = 0
    stmt = (
        select(Job.id, Job.class_, Job.priority, Job.created_at, Job.not_before)
        .where(Job.state == JobState.QUEUED)
        .execution_options(yield_per=_CHUNK)
    )
    pipe = redis.pipeline(transaction=False)
    for job_id, job_class, priority, created_at, not_before in session.execute(stmt):
        due = max(not_before or created_at, created_at)
        pipe.zadd(ready_key(prefix, job_class, priority), {job_id: due.timestamp()})
        queued.add(job_id)
        added += 1
        if added % _CHUNK == 0:
            pipe.execute()
    pipe.execute()

    removed = 0
    for key in ready_keys(prefix):
        members = [m.decode() if isinstance(m, bytes) else m for m in redis.zrange(key, 0, -1)]
        suspects = [m for m in members if m not in queued]
        for start in range(0, len(suspects), _CHUNK):
            chunk = suspects[start : start + _CHUNK]
            # Re-read: a job submitted after the scan above is queued and must stay.
            still = set(session.scalars(
                select(Job.id).where(Job.id.in_(chunk), Job.state == JobState.QUEUED)
            ))
            gone = [m for m in chunk if m not in still]
            if gone:
                removed += int(redis.zrem(key, *gone))
    session.rollback()  # end the read transaction; nothing was written
    return Rebuilt(added=added, removed=removed)
