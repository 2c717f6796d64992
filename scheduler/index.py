"""The batcher's Redis index: queued jobs per (model, class, priority, user), heads ordered by time.

`storage.ready` keeps one sorted set per class and priority, which answers "what is next" and
"how far back am I" but not "what is next for each user": one user's 10,000 overnight prompts
sit in front of another user's 10 in the same set. This index holds the same queued jobs once
more, split by user, so that a claim reads only the heads it needs: O(users), not O(jobs).

Keys (``P`` is ``Settings.redis_prefix``; ``Q`` is ``{model}:{class}:{priority}``):

- ``P sched:q:Q:{user}``: sorted set, job id -> due time (Unix seconds); one user's queue.
- ``P sched:u:Q``: sorted set, user -> due time of that user's oldest job; the due users of one
  model, class and priority are ``ZRANGEBYSCORE -inf now``.
- ``P sched:job``: hash, job id -> JSON ``[Q, user, class, priority, tokens, steps, deadline]``:
  what the policy needs without a database read, and where to remove the job from.
- ``P sched:active:{class}``: hash, user -> queued jobs in that class here; a user whose count
  goes from 0 to 1 starts at the class's virtual time (``P sched:vtime:{class}``, the service
  level of the latest pick), so idle time is neither credit nor debt (see `scheduler.policy`).
- ``P sched:built``: set once `reconcile` has filled the index from the database.

Feeding: `storage.ready.add` appends every id it indexes to ``P ready:new`` (a capped list);
`ingest` pops those, reads their rows and indexes the ones still queued. `reconcile` brings the
index in line with the database (missing jobs added, entries of jobs no longer queued dropped);
run it periodically beside `storage.ready.rebuild_ready_index`, and it runs by itself when the
index has never been built (a fresh or flushed Redis). Every queued job is in the index at most
once, and every entry leaves it when its job is claimed, expired, found stale or reconciled, so
the index is bounded by the queued jobs (plus entries gone stale since the last reconcile).

All changes to one user's queue and its head go through Lua scripts (atomic in Redis), so two
groups adding and removing at once leave every head right.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler.cost import tokens
from scheduler.policy import QueuedJob
from storage.models import Job, JobState
from storage.ready import new_key

CLASSES = ("interactive", "batch")
PRIORITIES = range(9, -1, -1)
INGEST_LIMIT = 1000  # ids taken from the new-entries list per call
_CHUNK = 1000

COLUMNS = (Job.id, Job.owner_id, Job.model, Job.class_, Job.priority, Job.width, Job.height,
           Job.num_frames, Job.num_inference_steps, Job.created_at, Job.not_before,
           Job.deadline, Job.state)

_ADD = """
local p = ARGV[1]
local added = 0
-- six arguments per job: id, Q, user, class, due, meta JSON
for i = 2, #ARGV, 6 do
  local id, q, user, class, due = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4]
  if redis.call('HEXISTS', p .. 'sched:job', id) == 0 then
    redis.call('HSET', p .. 'sched:job', id, ARGV[i+5])
    redis.call('ZADD', p .. 'sched:q:' .. q .. ':' .. user, due, id)
    redis.call('ZADD', p .. 'sched:u:' .. q, 'LT', due, user)
    if redis.call('HINCRBY', p .. 'sched:active:' .. class, user, 1) == 1 then
      local vt = tonumber(redis.call('GET', p .. 'sched:vtime:' .. class) or '0')
      local served = tonumber(redis.call('HGET', p .. 'sched:served:' .. class, user) or '0')
      if served < vt then
        redis.call('HSET', p .. 'sched:served:' .. class, user, tostring(vt))
      end
    end
    added = added + 1
  end
end
return added
"""

_REMOVE = """
local p = ARGV[1]
local removed = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local raw = redis.call('HGET', p .. 'sched:job', id)
  if raw then
    local m = cjson.decode(raw)
    local q, user, class = m[1], m[2], m[3]
    local qkey = p .. 'sched:q:' .. q .. ':' .. user
    redis.call('ZREM', qkey, id)
    redis.call('HDEL', p .. 'sched:job', id)
    local head = redis.call('ZRANGE', qkey, 0, 0, 'WITHSCORES')
    if #head == 0 then
      redis.call('ZREM', p .. 'sched:u:' .. q, user)
    else
      redis.call('ZADD', p .. 'sched:u:' .. q, head[2], user)
    end
    if redis.call('HINCRBY', p .. 'sched:active:' .. class, user, -1) <= 0 then
      redis.call('HDEL', p .. 'sched:active:' .. class, user)
    end
    removed = removed + 1
  end
end
return removed
"""

_LOAD = """
local out = {}
for i, key in ipairs(KEYS) do
  local r = redis.call('ZRANGE', key, 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
  local items = {}
  for j = 1, #r, 2 do
    items[#items + 1] = r[j]
    items[#items + 1] = r[j + 1]
    items[#items + 1] = redis.call('HGET', ARGV[2], r[j]) or ''
  end
  out[i] = items
end
return out
"""

_CHARGE = """
local p, class, user, estimate, cost = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[7]
local served = tonumber(redis.call('HGET', p .. 'sched:served:' .. class, user) or '0')
local vt = tonumber(redis.call('GET', p .. 'sched:vtime:' .. class) or '0')
if served > vt then
  redis.call('SET', p .. 'sched:vtime:' .. class, tostring(served))
end
redis.call('HINCRBYFLOAT', p .. 'sched:served:' .. class, user, estimate)
redis.call('SET', p .. 'sched:charge:' .. ARGV[5],
           cjson.encode({class, user, tonumber(estimate), tonumber(cost)}), 'EX', tonumber(ARGV[6]))
return 1
"""


def queue_name(model: str, job_class: str, priority: int) -> str:
    return f"{model}:{job_class}:{priority}"


def users_key(prefix: str, model: str, job_class: str, priority: int) -> str:
    return f"{prefix}sched:u:{queue_name(model, job_class, priority)}"


def queue_key(prefix: str, model: str, job_class: str, priority: int, owner: str) -> str:
    return f"{prefix}sched:q:{queue_name(model, job_class, priority)}:{owner}"


def jobs_key(prefix: str) -> str:
    return f"{prefix}sched:job"


def built_key(prefix: str) -> str:
    return f"{prefix}sched:built"


def served_key(prefix: str, job_class: str) -> str:
    return f"{prefix}sched:served:{job_class}"


def charge_key(prefix: str, job_id: str) -> str:
    return f"{prefix}sched:charge:{job_id}"


def queued_job(r: Any) -> QueuedJob:
    """A `QueuedJob` from a job row (a `Job`, or a row with the same attributes)."""
    due = max(r.not_before or r.created_at, r.created_at)
    return QueuedJob(
        job_id=r.id, owner=str(r.owner_id), model=r.model, job_class=r.class_,
        priority=r.priority, due=due.timestamp(),
        deadline=r.deadline.timestamp() if r.deadline is not None else None,
        num_tokens=tokens(r.width, r.height, r.num_frames), num_steps=r.num_inference_steps,
    )


def add(redis: Redis, prefix: str, jobs: Iterable[QueuedJob]) -> int:
    """Indexes queued jobs not yet in the index; returns how many were new."""
    args: list[Any] = []
    for j in jobs:
        q = queue_name(j.model, j.job_class, j.priority)
        meta = json.dumps([q, j.owner, j.job_class, j.priority, j.num_tokens, j.num_steps,
                           j.deadline, j.model])
        args += [j.job_id, q, j.owner, j.job_class, repr(j.due), meta]
    added = 0
    for start in range(0, len(args), 6 * _CHUNK):
        added += int(redis.eval(_ADD, 0, prefix, *args[start:start + 6 * _CHUNK]))
    return added


def remove(redis: Redis, prefix: str, job_ids: Sequence[str]) -> int:
    removed = 0
    for start in range(0, len(job_ids), _CHUNK):
        removed += int(redis.eval(_REMOVE, 0, prefix, *job_ids[start:start + _CHUNK]))
    return removed


def charge(redis: Redis, prefix: str, *, job_id: str, job_class: str, owner: str,
           cost_per_step: float, num_steps: int, ttl_seconds: int) -> None:
    """Charges a started job to its user and moves the class's virtual time to their level.
    The record (``P sched:charge:{job id}``) also keeps the job's estimated seconds per step."""
    redis.eval(_CHARGE, 0, prefix, job_class, owner, repr(cost_per_step * num_steps), job_id,
               ttl_seconds, repr(cost_per_step))


def step_costs(redis: Redis, prefix: str, job_ids: Sequence[str]) -> dict[str, float]:
    """Estimated seconds per step of started jobs, as charged (missing: unknown)."""
    if not job_ids:
        return {}
    out = {}
    for job_id, raw in zip(job_ids, redis.mget([charge_key(prefix, i) for i in job_ids]),
                           strict=True):
        if raw is not None:
            record = json.loads(raw)
            if len(record) > 3:
                out[job_id] = float(record[3])
    return out


def from_meta(job_id: str, due: float, raw: str | bytes) -> QueuedJob:
    _, owner, job_class, priority, num_tokens, num_steps, deadline, model = json.loads(raw)
    return QueuedJob(job_id=job_id, owner=owner, model=model, job_class=job_class,
                     priority=int(priority), due=due, deadline=deadline,
                     num_tokens=int(num_tokens), num_steps=int(num_steps))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ingest(session: Session, redis: Redis, prefix: str, limit: int = INGEST_LIMIT) -> int:
    """Indexes the jobs `storage.ready.add` announced since the last call; returns how many."""
    raw = redis.lpop(new_key(prefix), limit)
    if not raw:
        return 0
    ids = list(dict.fromkeys(_text(v) for v in raw))
    known = redis.hmget(jobs_key(prefix), ids)
    fresh = [i for i, k in zip(ids, known, strict=True) if k is None]
    if not fresh:
        return 0
    rows = list(session.execute(select(*COLUMNS).where(Job.id.in_(fresh),
                                                       Job.state == JobState.QUEUED)))
    session.rollback()  # end the read transaction
    return add(redis, prefix, (queued_job(r) for r in rows))


@dataclass(frozen=True, slots=True)
class Reconciled:
    added: int  # queued jobs that were missing from the index
    removed: int  # entries whose job is no longer queued


def reconcile(session: Session, redis: Redis, prefix: str) -> Reconciled:
    """Makes the index hold exactly the queued jobs. Safe beside claims and submits: it adds only
    jobs the database says are queued and drops an entry only after re-reading its job."""
    queued: set[str] = set()
    added = 0
    batch: list[Any] = []

    def flush() -> int:
        if not batch:
            return 0
        known = redis.hmget(jobs_key(prefix), [r.id for r in batch])
        n = add(redis, prefix, (queued_job(r) for r, k in zip(batch, known, strict=True)
                                if k is None))
        batch.clear()
        return n

    stmt = select(*COLUMNS).where(Job.state == JobState.QUEUED).execution_options(
        yield_per=_CHUNK)
    for row in session.execute(stmt):
        queued.add(row.id)
        batch.append(row)
        if len(batch) >= _CHUNK:
            added += flush()
    added += flush()
    session.rollback()
    suspects = [_text(k) for k in redis.hkeys(jobs_key(prefix)) if _text(k) not in queued]
    removed = 0
    for start in range(0, len(suspects), _CHUNK):
        chunk = suspects[start:start + _CHUNK]
        still = set(session.scalars(select(Job.id).where(Job.id.in_(chunk),
                                                         Job.state == JobState.QUEUED)))
        session.rollback()
        removed += remove(redis, prefix, [i for i in chunk if i not in still])
    redis.set(built_key(prefix), "1")
    return Reconciled(added=added, removed=removed)


def ensure_built(session: Session, redis: Redis, prefix: str) -> None:
    """Builds the index from the database the first time any group needs it."""
    if redis.exists(built_key(prefix)):
        return
    # One builder at a time; the others go on with what the index already holds.
    if redis.set(f"{prefix}sched:building", "1", nx=True, ex=300):
        try:
            reconcile(session, redis, prefix)
        finally:
            redis.delete(f"{prefix}sched:building")


def due_heads(redis: Redis, prefix: str, model: str,
              now: float) -> list[tuple[str, int, str, float]]:
    """(class, priority, user, due of that user's oldest job) for every due user queue."""
    order = [(c, p) for c in CLASSES for p in PRIORITIES]
    pipe = redis.pipeline(transaction=False)
    for c, p in order:
        pipe.zrangebyscore(users_key(prefix, model, c, p), "-inf", now, withscores=True)
    out = []
    for (c, p), heads in zip(order, pipe.execute(), strict=True):
        out += [(c, p, _text(user), float(due)) for user, due in heads]
    return out


def load(redis: Redis, prefix: str, model: str, queues: Sequence[tuple[str, int, str]],
         count: int) -> list[QueuedJob]:
    """The ``count`` oldest jobs of each (class, priority, user) queue of ``model``."""
    if not queues:
        return []
    keys = [queue_key(prefix, model, c, p, u) for c, p, u in queues]
    out: list[QueuedJob] = []
    for items in redis.eval(_LOAD, len(keys), *keys, count, jobs_key(prefix)):
        for i in range(0, len(items), 3):
            job_id, due, raw = _text(items[i]), float(items[i + 1]), items[i + 2]
            if raw:  # an id without its meta is mid-removal: skip it
                out.append(from_meta(job_id, due, raw))
    return out


def index_keys(redis: Redis, prefix: str) -> list[str]:
    return [_text(k) for k in redis.scan_iter(match=f"{prefix}sched:*", count=1000)]


def memory_bytes(redis: Redis, keys: Iterable[str]) -> int:
    pipe = redis.pipeline(transaction=False)
    names = list(keys)
    for k in names:
        pipe.memory_usage(k, samples=0)
    return sum(int(v or 0) for v in pipe.execute()) if names else 0
