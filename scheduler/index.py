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

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import NoScriptError
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler.cost import tokens
from scheduler.policy import CLASS_BASE, TOP_LEVEL, QueuedJob
from storage.models import Job, JobState
from storage.ready import new_key

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

_PICK = """
local p, model = ARGV[1], ARGV[2]
local now, aging = tonumber(ARGV[3]), tonumber(ARGV[4])
local want, count, top_level = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local base = {interactive = tonumber(ARGV[8]), batch = tonumber(ARGV[9])}
local function level(b, due)
  local waited = math.max(0, now - due)
  return math.min(top_level, b + math.floor(waited / aging))
end
-- 1. the oldest head of every (class, priority): the highest level each can offer
local keys, top = {}, -1
for _, c in ipairs({'interactive', 'batch'}) do
  for prio = 9, 0, -1 do
    local key = p .. 'sched:u:' .. model .. ':' .. c .. ':' .. prio
    local h = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if #h > 0 and tonumber(h[2]) <= now then
      local b = base[c] + prio
      local l = level(b, tonumber(h[2]))
      keys[#keys + 1] = {key, c, prio, b, l}
      top = math.max(top, l)
    end
  end
end
-- 2. level by level from the top: the user queues whose head is at that level, least served
--    first (oldest first at the top level), until `want` queues are picked
local picked, L = {}, top
while L >= 0 and #picked < want do
  local band = {}
  for _, k in ipairs(keys) do
    local key, c, prio, b, maxl = k[1], k[2], k[3], k[4], k[5]
    if maxl >= L and L >= b then
      local hi, r = now - (L - b) * aging, nil
      if L < top_level then
        local lo = '(' .. tostring(now - (L - b + 1) * aging)
        r = redis.call('ZRANGEBYSCORE', key, lo, hi, 'WITHSCORES')
      else  -- oldest first: the first `want` of each key are enough
        r = redis.call('ZRANGEBYSCORE', key, '-inf', hi, 'WITHSCORES', 'LIMIT', 0, want)
      end
      for j = 1, #r, 2 do
        local served = 0
        if L < top_level then
          served = tonumber(redis.call('HGET', p .. 'sched:served:' .. c, r[j]) or '0')
        end
        band[#band + 1] = {c, prio, r[j], tonumber(r[j + 1]), served}
      end
    end
  end
  table.sort(band, function(x, y)
    if x[5] ~= y[5] then return x[5] < y[5] end
    return x[4] < y[4]
  end)
  for i = 1, math.min(#band, want - #picked) do
    picked[#picked + 1] = band[i]
  end
  L = L - 1
end
-- 3. each picked queue's `count` oldest jobs with what the policy needs, and the user's service
local out = {}
for _, q in ipairs(picked) do
  local c, prio, user = q[1], q[2], q[3]
  local qkey = p .. 'sched:q:' .. model .. ':' .. c .. ':' .. prio .. ':' .. user
  local item = {c, user, redis.call('HGET', p .. 'sched:served:' .. c, user) or '0'}
  local r = redis.call('ZRANGE', qkey, 0, count - 1, 'WITHSCORES')
  for j = 1, #r, 2 do
    item[#item + 1] = r[j]
    item[#item + 1] = r[j + 1]
    item[#item + 1] = redis.call('HGET', p .. 'sched:job', r[j]) or ''
  end
  out[#out + 1] = item
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


_SCRIPTS = {name: (text, hashlib.sha1(text.encode()).hexdigest())
            for name, text in (("add", _ADD), ("remove", _REMOVE), ("pick", _PICK),
                               ("charge", _CHARGE))}


def _run(redis: Redis | Pipeline, name: str, *args: Any) -> Any:
    """A script by its SHA (the text goes over the wire only when Redis lacks it). In a
    pipeline the script must already be loaded (`load_scripts`)."""
    text, sha = _SCRIPTS[name]
    if isinstance(redis, Pipeline):
        return redis.evalsha(sha, 0, *args)
    try:
        return redis.evalsha(sha, 0, *args)
    except NoScriptError:
        return redis.eval(text, 0, *args)


def script_shas() -> list[str]:
    return [sha for _, sha in _SCRIPTS.values()]


def load_scripts(redis: Redis) -> None:
    shas = [sha for _, sha in _SCRIPTS.values()]
    for (text, _), present in zip(_SCRIPTS.values(), redis.script_exists(*shas), strict=True):
        if not present:
            redis.script_load(text)


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
        added += int(_run(redis, "add", prefix, *args[start:start + 6 * _CHUNK]))
    return added


def remove(redis: Redis | Pipeline, prefix: str, job_ids: Sequence[str]) -> int:
    """Drops jobs from the index (a pipeline queues the removal and returns 0)."""
    removed = 0
    for start in range(0, len(job_ids), _CHUNK):
        reply = _run(redis, "remove", prefix, *job_ids[start:start + _CHUNK])
        removed += 0 if isinstance(redis, Pipeline) else int(reply)
    return removed


def charge(redis: Redis | Pipeline, prefix: str, *, job_id: str, job_class: str, owner: str,
           cost_per_step: float, num_steps: int, ttl_seconds: int) -> None:
    """Charges a started job to its user and moves the class's virtual time to their level.
    The record (``P sched:charge:{job id}``) also keeps the job's estimated seconds per step."""
    _run(redis, "charge", prefix, job_class, owner, repr(cost_per_step * num_steps), job_id,
         ttl_seconds, repr(cost_per_step))


def charged_step_cost(raw: str | bytes) -> float | None:
    """The estimated seconds per step kept in a charge record (``P sched:charge:{job id}``)."""
    record = json.loads(raw)
    return float(record[3]) if len(record) > 3 else None


def from_meta(job_id: str, due: float, raw: str | bytes) -> QueuedJob:
    _, owner, job_class, priority, num_tokens, num_steps, deadline, model = json.loads(raw)
    return QueuedJob(job_id=job_id, owner=owner, model=model, job_class=job_class,
                     priority=int(priority), due=due, deadline=deadline,
                     num_tokens=int(num_tokens), num_steps=int(num_steps))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ingest(session: Session, redis: Redis, prefix: str, limit: int = INGEST_LIMIT,
           raw: Sequence[str | bytes] | None = None) -> int:
    """Indexes the jobs `storage.ready.add` announced since the last call; returns how many.
    ``raw``: ids the caller already popped from ``P ready:new`` (else up to ``limit`` are)."""
    if raw is None:
        raw = redis.lpop(new_key(prefix), limit)
    if not raw:
        return 0
    ids = list(dict.fromkeys(_text(v) for v in raw))
    known = redis.hmget(jobs_key(prefix), ids)
    fresh = [i for i, k in zip(ids, known, strict=True) if k is None]
    if not fresh:
        return 0
    # By primary key only: with the state in the WHERE, SQLite prefers the state index and
    # walks every queued job.
    rows = [r for r in session.execute(select(*COLUMNS).where(Job.id.in_(fresh)))
            if r.state == JobState.QUEUED]
    session.rollback()  # end the read transaction
    return add(redis, prefix, (queued_job(r) for r in rows))


@dataclass(frozen=True, slots=True)
class Reconciled:
    added: int  # queued jobs that were missing from the index
    removed: int  # entries whose job is no longer queued


def reconcile(session: Session, redis: Redis, prefix: str) -> Reconciled:
    """Makes the index hold exactly the queued jobs. Safe beside claims and submits: it adds only
    jobs the database says are queued and drops an entry only after re-reading its job."""
    # Everything announced so far is committed, so the scan below sees it: the backlog of
    # announcements can go (ids announced from now on are ingested as usual).
    redis.delete(new_key(prefix))
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
        still = {i for i, state in session.execute(select(Job.id, Job.state).where(
            Job.id.in_(chunk))) if state == JobState.QUEUED}
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


def pick(redis: Redis, prefix: str, model: str, *, now: float, aging_seconds: float,
         num_queues: int, num_jobs: int) -> tuple[list[QueuedJob], dict[tuple[str, str], float]]:
    """The jobs that can win the next picks, in one round trip, and their users' service.

    In Redis (a Lua script, so the view is consistent): the highest level any head offers, then
    level by level downwards the user queues whose head is at that level, least served first
    (oldest first at the top level) -- the policy's own order -- until ``num_queues`` are taken;
    then the ``num_jobs`` oldest jobs of each. Only heads of the levels needed are read.
    """
    reply = _run(redis, "pick", prefix, model, repr(now), repr(aging_seconds), num_queues,
                       num_jobs, TOP_LEVEL, CLASS_BASE["interactive"], CLASS_BASE["batch"])
    jobs: list[QueuedJob] = []
    served: dict[tuple[str, str], float] = {}
    for item in reply:
        job_class, owner = _text(item[0]), _text(item[1])
        served[(job_class, owner)] = float(item[2])
        for i in range(3, len(item), 3):
            job_id, due, raw = _text(item[i]), float(item[i + 1]), item[i + 2]
            if raw:  # an id without its meta is mid-removal: skip it
                jobs.append(from_meta(job_id, due, raw))
    return jobs, served


def index_keys(redis: Redis, prefix: str) -> list[str]:
    return [_text(k) for k in redis.scan_iter(match=f"{prefix}sched:*", count=1000)]


def memory_bytes(redis: Redis, keys: Iterable[str]) -> int:
    pipe = redis.pipeline(transaction=False)
    names = list(keys)
    for k in names:
        pipe.memory_usage(k, samples=0)
    return sum(int(v or 0) for v in pipe.execute()) if names else 0
