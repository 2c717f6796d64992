"""The Redis index of queued jobs: queue positions, the batcher's picks, and wake-ups.

The database is the truth; this index saves the API and the batcher from scanning it. Losing it
loses nothing: `reconcile` puts back every queued job, and runs by itself at the next claim when
the index was never built (a fresh or flushed Redis). A stale entry (a job no longer queued) is
harmless: the database refuses to claim it, and the claimer drops it.

Keys (``P`` is ``Settings.redis_prefix``, ``kiln:`` by default; ``Q`` is
``{model}:{class}:{priority}``):

- ``P ready:{class}:{priority}``: sorted set, job id -> due time (Unix seconds), one per class
  and priority; `ready_keys` lists them in serving order (interactive 9..0, then batch 9..0), so
  a job's queue position is the entries of the keys before its own plus its rank in it.
- ``P ready:wake``: list of at most `WAKE_CAP` tokens, one pushed by every `add`; an idle worker
  group blocks on it (`wait_for_work`) instead of sleeping between looks. A lost or extra token
  costs one look: groups still look on their own every poll interval.
- ``P sched:q:Q:{user}``: sorted set, job id -> due time; one user's queue.
- ``P sched:u:Q``: sorted set, user -> due time of that user's oldest job.
- ``P sched:job``: hash, job id -> JSON ``[Q, user, class, priority, tokens, steps, deadline,
  model]``: what the policy needs without a database read, and where to remove the job from.
- ``P sched:active:{class}``: hash, user -> queued jobs in that class; a user whose count goes
  from 0 to 1 starts at the class's virtual time (``P sched:vtime:{class}``, the service level of
  the latest pick), so idle time is neither credit nor debt (see `scheduler.policy`).
- ``P sched:served:{class}``: hash, user -> service in render seconds; ``P sched:charge:{job}``:
  a started job's charge until `scheduler.claim.record_result` settles it.
- ``P sched:built``: set once `reconcile` has filled the index from the database.

`add` and `remove` each run as one Lua script (atomic in Redis), so a job enters and leaves all
of its keys at once, and two groups adding and removing at once leave every user's head right.
The scripts get the classes in serving order and the priority bounds as arguments.
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

from common.families import family_of
from scheduler.cost import tokens
from scheduler.policy import CLASS_BASE, INTERACTIVE, TOP_LEVEL, QueuedJob, class_bases
from storage.tables import MAX_PRIORITY, MIN_PRIORITY, Job, JobClass, JobState

# Every class, in serving order: the one whose jobs start at the higher level first.
CLASSES = tuple(sorted((c.value for c in JobClass), key=CLASS_BASE.__getitem__, reverse=True))
# Wake tokens kept for idle worker groups: enough to wake every group of a large deployment for
# a burst of submissions, few enough that a backlog of them makes only a few needless looks.
WAKE_CAP = 64
_CHUNK = 1000

COLUMNS = (Job.id, Job.owner_id, Job.model, Job.class_, Job.priority, Job.width, Job.height,
           Job.num_frames, Job.num_inference_steps, Job.created_at, Job.not_before,
           Job.deadline, Job.state)

# Shared by every script. ARGV[1]: the key prefix; ARGV[2]: the classes in serving order,
# comma-separated; ARGV[3], ARGV[4]: the highest and the lowest priority. The script's own
# arguments start at ARGV[5].
_COMMON = """
local p = ARGV[1]
local classes = {}
for c in string.gmatch(ARGV[2], '[^,]+') do
  classes[#classes + 1] = c
end
local max_prio, min_prio = tonumber(ARGV[3]), tonumber(ARGV[4])
local function ready_key(c, prio)
  return p .. 'ready:' .. c .. ':' .. prio
end
-- entries ahead of the job in serving order, -1 if it is not in its ready key
local function position(id, class, prio)
  local ahead = 0
  for _, c in ipairs(classes) do
    for q = max_prio, min_prio, -1 do
      local key = ready_key(c, q)
      if c == class and q == prio then
        local rank = redis.call('ZRANK', key, id)
        if not rank then
          return -1
        end
        return ahead + rank
      end
      ahead = ahead + redis.call('ZCARD', key)
    end
  end
  return -1
end
"""

_ADD = """
-- ARGV[5]: wake tokens to keep (0: push none); ARGV[6]: '1' to return the last job's position;
-- then seven per job: id, Q, user, class, priority, due, meta JSON
local wake_cap, want_position = tonumber(ARGV[5]), ARGV[6] == '1'
local added, last = 0, nil
for i = 7, #ARGV, 7 do
  local id, q, user, class, prio, due = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4],
                                        ARGV[i+5]
  redis.call('ZADD', ready_key(class, prio), due, id)
  if redis.call('HEXISTS', p .. 'sched:job', id) == 0 then
    redis.call('HSET', p .. 'sched:job', id, ARGV[i+6])
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
  last = i
end
if last and wake_cap > 0 then
  redis.call('RPUSH', p .. 'ready:wake', '1')
  redis.call('LTRIM', p .. 'ready:wake', -wake_cap, -1)
end
local pos = -1
if last and want_position then
  pos = position(ARGV[last], ARGV[last + 3], tonumber(ARGV[last + 4]))
end
return {added, pos}
"""

_REMOVE = """
-- ARGV[5..]: job ids
local removed = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local found = false
  local raw = redis.call('HGET', p .. 'sched:job', id)
  if raw then
    local m = cjson.decode(raw)
    local q, user, class, prio = m[1], m[2], m[3], m[4]
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
    redis.call('ZREM', ready_key(class, prio), id)
    found = true
  else  -- not in the per-user keys: wherever it is in the serving order
    for _, c in ipairs(classes) do
      for q = max_prio, min_prio, -1 do
        if redis.call('ZREM', ready_key(c, q), id) == 1 then
          found = true
        end
      end
    end
  end
  if found then
    removed = removed + 1
  end
end
return removed
"""

_RESTORE = """
-- ARGV[5..]: four per job: id, class, priority, due. Puts each job in its ready key and returns
-- the ids the per-user keys lack (those need `add`, with their meta).
local missing = {}
for i = 5, #ARGV, 4 do
  redis.call('ZADD', ready_key(ARGV[i+1], ARGV[i+2]), ARGV[i+3], ARGV[i])
  if redis.call('HEXISTS', p .. 'sched:job', ARGV[i]) == 0 then
    missing[#missing + 1] = ARGV[i]
  end
end
return missing
"""

_POSITION = """
-- ARGV[5..7]: job id, class, priority
return position(ARGV[5], ARGV[6], tonumber(ARGV[7]))
"""

_PICK = """
-- ARGV[5..10]: model, now, aging seconds, queues wanted, jobs per queue, top level;
-- ARGV[11..]: each class's base level for this group (`policy.class_bases`), in the order of
-- ARGV[2]
local model = ARGV[5]
local now, aging = tonumber(ARGV[6]), tonumber(ARGV[7])
local want, count, top_level = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local base = {}
for i, c in ipairs(classes) do
  base[c] = tonumber(ARGV[10 + i])
end
local function level(b, due)
  local waited = math.max(0, now - due)
  return math.min(top_level, b + math.floor(waited / aging))
end
-- 1. the oldest head of every (class, priority): the highest level each can offer
local keys, top = {}, -1
for _, c in ipairs(classes) do
  for prio = max_prio, min_prio, -1 do
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
-- ARGV[5..10]: class, user, estimated seconds, job id, record TTL, estimated seconds per step
local class, user, estimate, cost = ARGV[5], ARGV[6], ARGV[7], ARGV[10]
local served = tonumber(redis.call('HGET', p .. 'sched:served:' .. class, user) or '0')
local vt = tonumber(redis.call('GET', p .. 'sched:vtime:' .. class) or '0')
if served > vt then
  redis.call('SET', p .. 'sched:vtime:' .. class, tostring(served))
end
redis.call('HINCRBYFLOAT', p .. 'sched:served:' .. class, user, estimate)
redis.call('SET', p .. 'sched:charge:' .. ARGV[8],
           cjson.encode({class, user, tonumber(estimate), tonumber(cost)}), 'EX', tonumber(ARGV[9]))
return 1
"""

_SCRIPTS = {name: (_COMMON + body, hashlib.sha1((_COMMON + body).encode()).hexdigest())
            for name, body in (("add", _ADD), ("remove", _REMOVE), ("restore", _RESTORE),
                               ("position", _POSITION), ("pick", _PICK), ("charge", _CHARGE))}


def _run(redis: Redis | Pipeline, name: str, prefix: str, *args: Any) -> Any:
    """A script by its SHA (the text goes over the wire only when Redis lacks it), with the
    bounds every script takes. In a pipeline the script must already be loaded
    (`load_scripts`)."""
    text, sha = _SCRIPTS[name]
    argv = (prefix, ",".join(CLASSES), MAX_PRIORITY, MIN_PRIORITY, *args)
    if isinstance(redis, Pipeline):
        return redis.evalsha(sha, 0, *argv)
    try:
        return redis.evalsha(sha, 0, *argv)
    except NoScriptError:  # the first call after Redis started (or flushed its scripts)
        return redis.eval(text, 0, *argv)


def script_shas() -> list[str]:
    return [sha for _, sha in _SCRIPTS.values()]


def load_scripts(redis: Redis) -> None:
    shas = script_shas()
    for (text, _), present in zip(_SCRIPTS.values(), redis.script_exists(*shas), strict=True):
        if not present:
            redis.script_load(text)


def ready_key(prefix: str, job_class: str, priority: int) -> str:
    return f"{prefix}ready:{job_class}:{priority}"


def ready_keys(prefix: str) -> list[str]:
    """Every ready key, in the order they are served."""
    return [ready_key(prefix, c, p) for c in CLASSES
            for p in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1)]


def wake_key(prefix: str) -> str:
    return f"{prefix}ready:wake"


def queue_name(model: str, job_class: str, priority: int) -> str:
    return f"{model}:{job_class}:{priority}"


def users_key(prefix: str, model: str, job_class: str, priority: int) -> str:
    return f"{prefix}sched:u:{queue_name(model, job_class, priority)}"


def queue_key(prefix: str, model: str, job_class: str, priority: int, owner: str) -> str:
    return f"{prefix}sched:q:{queue_name(model, job_class, priority)}:{owner}"


def has_due(redis: Redis, prefix: str, model: str, job_class: str, now: float) -> bool:
    """Whether some user's queue of ``job_class`` jobs for ``model`` has a job due by ``now``
    (one round trip; a stale entry can make it say yes: the claim that follows finds out)."""
    pipe = redis.pipeline(transaction=False)
    for priority in range(MIN_PRIORITY, MAX_PRIORITY + 1):
        pipe.zrangebyscore(users_key(prefix, model, job_class, priority), "-inf", repr(now),
                           start=0, num=1)
    return any(pipe.execute())


def jobs_key(prefix: str) -> str:
    return f"{prefix}sched:job"


def built_key(prefix: str) -> str:
    return f"{prefix}sched:built"


def served_key(prefix: str, job_class: str) -> str:
    return f"{prefix}sched:served:{job_class}"


def charge_key(prefix: str, job_id: str) -> str:
    return f"{prefix}sched:charge:{job_id}"


def due(job: Any) -> float:
    """Unix seconds from which a job may start: its ``not_before``, never before its creation
    (``job``: a `Job`, or a row with ``created_at`` and ``not_before``)."""
    return max(job.not_before or job.created_at, job.created_at).timestamp()


def queued_job(r: Any) -> QueuedJob:
    """A `QueuedJob` from a job row (a `Job`, or a row with the same attributes)."""
    return QueuedJob(
        job_id=r.id, owner=str(r.owner_id), model=r.model, job_class=r.class_,
        priority=r.priority, due=due(r),
        deadline=r.deadline.timestamp() if r.deadline is not None else None,
        num_tokens=tokens(r.width, r.height, r.num_frames, family=family_of(r.model)),
        num_inference_steps=r.num_inference_steps,
    )


def _entry(j: QueuedJob) -> list[Any]:
    """A job's seven arguments to the add script."""
    q = queue_name(j.model, j.job_class, j.priority)
    meta = json.dumps([q, j.owner, j.job_class, j.priority, j.num_tokens, j.num_inference_steps,
                       j.deadline, j.model])
    return [j.job_id, q, j.owner, j.job_class, j.priority, repr(j.due), meta]


def _add(redis: Redis, prefix: str, jobs: Iterable[Job | QueuedJob], *, wake: bool,
         with_position: bool = False) -> tuple[int, int | None]:
    """Jobs new to the per-user keys, and the last job's position when asked for."""
    args: list[Any] = []
    for j in jobs:
        args += _entry(j if isinstance(j, QueuedJob) else queued_job(j))
    added, found = 0, -1
    for start in range(0, len(args), 7 * _CHUNK):
        n, found = _run(redis, "add", prefix, WAKE_CAP if wake and not start else 0,
                        "1" if with_position else "0", *args[start:start + 7 * _CHUNK])
        added += int(n)
    return added, None if int(found) < 0 else int(found)


def add(redis: Redis, prefix: str, jobs: Iterable[Job | QueuedJob]) -> int:
    """Indexes queued jobs everywhere (call only after the transaction that queued them has
    committed) and wakes an idle worker group; returns how many were not yet indexed."""
    return _add(redis, prefix, jobs, wake=True)[0]


def add_one(redis: Redis, prefix: str, job: Job) -> int | None:
    """`add` for one job, returning its `position`, in one round trip (what every submit
    does)."""
    return _add(redis, prefix, [job], wake=True, with_position=True)[1]


def remove(redis: Redis | Pipeline, prefix: str, job_ids: Sequence[str]) -> int:
    """Drops jobs from every key of the index; returns how many were in it (a pipeline queues
    the removal and returns 0)."""
    removed = 0
    for start in range(0, len(job_ids), _CHUNK):
        reply = _run(redis, "remove", prefix, *job_ids[start:start + _CHUNK])
        removed += 0 if isinstance(redis, Pipeline) else int(reply)
    return removed


def position(redis: Redis, prefix: str, job: Job) -> int | None:
    """Entries ahead of ``job`` in serving order, in O(log n) for its own key; None if the job
    is not in the index (not queued, or the index is being rebuilt)."""
    found = int(_run(redis, "position", prefix, job.id, job.class_, job.priority))
    return None if found < 0 else found


def wait_for_work(redis: Redis, prefix: str, timeout_seconds: float) -> bool:
    """Blocks until `add` announces new work or ``timeout_seconds`` pass; True if it did."""
    # BLPOP's timeout is in seconds (fractions allowed); 0 would mean "forever".
    return redis.blpop([wake_key(prefix)], timeout=max(timeout_seconds, 0.001)) is not None


def charge(redis: Redis | Pipeline, prefix: str, *, job_id: str, job_class: str, owner: str,
           cost_per_step: float, num_inference_steps: int, ttl_seconds: int) -> None:
    """Charges a started job to its user and moves the class's virtual time to their level.
    The record (``P sched:charge:{job id}``) also keeps the job's estimated seconds per step."""
    _run(redis, "charge", prefix, job_class, owner,
         repr(cost_per_step * num_inference_steps), job_id, ttl_seconds, repr(cost_per_step))


def charged_step_cost(raw: str | bytes) -> float | None:
    """The estimated seconds per step kept in a charge record (``P sched:charge:{job id}``)."""
    record = json.loads(raw)
    return float(record[3]) if len(record) > 3 else None


def from_meta(job_id: str, job_due: float, raw: str | bytes) -> QueuedJob:
    """The `QueuedJob` a ``P sched:job`` entry describes."""
    _, owner, job_class, priority, num_tokens, num_inference_steps, deadline, model = \
        json.loads(raw)
    return QueuedJob(job_id=job_id, owner=owner, model=model, job_class=job_class,
                     priority=int(priority), due=job_due, deadline=deadline,
                     num_tokens=int(num_tokens), num_inference_steps=int(num_inference_steps))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def pick(redis: Redis, prefix: str, model: str, *, now: float, aging_seconds: float,
         num_queues: int, num_jobs: int, prefer: str = INTERACTIVE,
         ) -> tuple[list[QueuedJob], dict[tuple[str, str], float]]:
    """The jobs that can win the next picks, in one round trip, and their users' service.

    In Redis (a Lua script, so the view is consistent): the highest level any head offers, then
    level by level downwards the user queues whose head is at that level, least served first
    (oldest first at the top level) -- the policy's own order -- until ``num_queues`` are taken;
    then the ``num_jobs`` oldest jobs of each. Only heads of the levels needed are read. Levels
    are those of a group that prefers the class ``prefer`` (`scheduler.policy.class_bases`).
    """
    bases = class_bases(prefer)
    reply = _run(redis, "pick", prefix, model, repr(now), repr(aging_seconds), num_queues,
                 num_jobs, TOP_LEVEL, *(bases[c] for c in CLASSES))
    jobs: list[QueuedJob] = []
    served: dict[tuple[str, str], float] = {}
    for item in reply:
        job_class, owner = _text(item[0]), _text(item[1])
        served[(job_class, owner)] = float(item[2])
        for i in range(3, len(item), 3):
            job_id, job_due, raw = _text(item[i]), float(item[i + 1]), item[i + 2]
            if raw:  # an id without its meta is mid-removal: skip it
                jobs.append(from_meta(job_id, job_due, raw))
    return jobs, served


@dataclass(frozen=True, slots=True)
class Reconciled:
    added: int  # queued jobs that were missing from the index
    removed: int  # entries whose job is no longer queued


def _restore(redis: Redis, prefix: str, rows: Sequence[Any]) -> int:
    """Puts queued rows back where they are missing; returns how many the per-user keys lacked.
    A job the per-user keys hold needs only its ready key, which costs no meta."""
    args: list[Any] = []
    for r in rows:
        args += [r.id, r.class_, r.priority, repr(due(r))]
    lacking = {_text(i) for i in _run(redis, "restore", prefix, *args)}
    missing = [queued_job(r) for r in rows if r.id in lacking]
    return _add(redis, prefix, missing, wake=False)[0] if missing else 0


def reconcile(session: Session, redis: Redis, prefix: str) -> Reconciled:
    """Makes the index hold exactly the queued jobs. Safe beside claims and submits: it adds only
    jobs the database says are queued and drops an entry only after re-reading its job."""
    queued: set[str] = set()
    added = 0
    batch: list[Any] = []
    stmt = select(*COLUMNS).where(Job.state == JobState.QUEUED).execution_options(
        yield_per=_CHUNK)
    for row in session.execute(stmt):
        queued.add(row.id)
        batch.append(row)
        if len(batch) >= _CHUNK:
            added += _restore(redis, prefix, batch)
            batch.clear()
    if batch:
        added += _restore(redis, prefix, batch)
    session.rollback()  # end the read transaction; nothing was written

    pipe = redis.pipeline(transaction=False)
    pipe.hkeys(jobs_key(prefix))
    for key in ready_keys(prefix):
        pipe.zrange(key, 0, -1)
    listed = {_text(m) for members in pipe.execute() for m in members}
    suspects = sorted(listed - queued)
    removed = 0
    for start in range(0, len(suspects), _CHUNK):
        chunk = suspects[start:start + _CHUNK]
        # Re-read: a job submitted after the scan above is queued and must stay.
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


def index_keys(redis: Redis, prefix: str) -> list[str]:
    """The batcher's keys (``P sched:*``): per-user queues, heads, metas, accounting."""
    return [_text(k) for k in redis.scan_iter(match=f"{prefix}sched:*", count=1000)]


def memory_bytes(redis: Redis, keys: Iterable[str]) -> int:
    pipe = redis.pipeline(transaction=False)
    names = list(keys)
    for k in names:
        pipe.memory_usage(k, samples=0)
    return sum(int(v or 0) for v in pipe.execute()) if names else 0
