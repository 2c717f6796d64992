"""The Redis index of queued jobs: queue positions, the batcher's picks, and wake-ups.

The database is the truth; this index saves the API and the batcher from scanning it. Losing it
loses nothing: `reconcile` puts back every queued job, and runs by itself at the next claim when
the index was never built (a fresh or flushed Redis) or was built in another record format. A
stale entry (a job no longer queued) is harmless: the database refuses to claim it, and the
claimer drops it.

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
- ``P sched:job``: hash, job id -> `scheduler.records.JobMeta` (owner, model, class, priority,
  tokens, steps, deadline): what the policy needs without a database read, and where to remove
  the job from.
- ``P sched:active:{class}``: hash, user -> queued jobs in that class; a user whose count goes
  from 0 to 1 starts at the class's virtual time (``P sched:vtime:{class}``, the service level of
  the latest pick), so idle time is neither credit nor debt (see `scheduler.policy`).
- ``P sched:served:{class}``: hash, user -> service in render seconds; ``P sched:charge:{job}``:
  a started job's charge (`scheduler.records.ChargeRecord`) until
  `scheduler.claim.record_result` settles it.
- ``P sched:built``: the record format (`scheduler.records.FORMAT`) `reconcile` filled the index
  in from the database; an index marked with another format is cleared and rebuilt.

`add` and `settle` (a claim's charges and removals; `charge` and `remove` are its parts) each run
as one Lua script (atomic in Redis), so a job enters and leaves all of its keys at once, and two
groups adding and removing at once leave every user's head right.
The scripts live in ``scheduler/lua`` (a shared prelude, ``common.lua``, then one file each) and
read records by the field names of `scheduler.records`; they get the classes in serving order and
the priority bounds as arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis import Redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from common.families import family_of
from scheduler.cost import tokens
from scheduler.policy import CLASS_BASE, INTERACTIVE, TOP_LEVEL, QueuedJob, class_bases
from scheduler.records import FORMAT, ChargeRecord, JobMeta
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


def _script(name: str) -> str:
    """``scheduler/lua/{name}.lua`` with the prelude every script shares in front of it."""
    lua = resources.files(__package__) / "lua"
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


_SCRIPTS = {name: _script(name) for name in ("add", "settle", "restore", "position", "pick")}


def _run(redis: Redis, name: str, prefix: str, *args: Any) -> Any:
    """Runs a script with the bounds every script takes. redis-py's `Script` sends it by SHA and
    loads it where Redis lacks it."""
    argv = (prefix, ",".join(CLASSES), MAX_PRIORITY, MIN_PRIORITY, *args)
    return redis.register_script(_SCRIPTS[name])(args=argv)


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


def active_key(prefix: str, job_class: str) -> str:
    return f"{prefix}sched:active:{job_class}"


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
    """A job's three arguments to the add script."""
    return [j.job_id, repr(j.due), JobMeta.of(j).encode()]


def _add(redis: Redis, prefix: str, jobs: Iterable[Job | QueuedJob], *, wake: bool,
         with_position: bool = False) -> tuple[int, int | None]:
    """Jobs new to the per-user keys, and the last job's position when asked for."""
    args: list[Any] = []
    for j in jobs:
        args += _entry(j if isinstance(j, QueuedJob) else queued_job(j))
    added, found = 0, -1
    for start in range(0, len(args), 3 * _CHUNK):
        n, found = _run(redis, "add", prefix, WAKE_CAP if wake and not start else 0,
                        "1" if with_position else "0", *args[start:start + 3 * _CHUNK])
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


def settle(redis: Redis, prefix: str, *, started: Sequence[tuple[str, ChargeRecord]] = (),
           done: Sequence[str] = (), ttl_seconds: int = 0) -> int:
    """In one script: charges each started job (id, charge) to its user, moving the class's
    virtual time to their level, and keeps the charge as ``P sched:charge:{job id}`` for
    ``ttl_seconds``; then drops the ``done`` jobs from every key of the index. Returns how many
    of those were in it."""
    charges = [a for job_id, record in started for a in (job_id, record.encode())]
    removed = 0
    for start in range(0, max(len(done), 1), _CHUNK):
        removed += int(_run(redis, "settle", prefix, ttl_seconds, len(charges) // 2, *charges,
                            *done[start:start + _CHUNK]))
        charges = []
    return removed


def remove(redis: Redis, prefix: str, job_ids: Sequence[str]) -> int:
    """Drops jobs from every key of the index; returns how many were in it."""
    return settle(redis, prefix, done=job_ids) if job_ids else 0


def position(redis: Redis, prefix: str, job: Job) -> int | None:
    """Entries ahead of ``job`` in serving order, in O(log n) for its own key; None if the job
    is not in the index (not queued, or the index is being rebuilt)."""
    found = int(_run(redis, "position", prefix, job.id, job.class_, job.priority))
    return None if found < 0 else found


def wait_for_work(redis: Redis, prefix: str, timeout_seconds: float) -> bool:
    """Blocks until `add` announces new work or ``timeout_seconds`` pass; True if it did."""
    # BLPOP's timeout is in seconds (fractions allowed); 0 would mean "forever".
    return redis.blpop([wake_key(prefix)], timeout=max(timeout_seconds, 0.001)) is not None


def charge(redis: Redis, prefix: str, *, job_id: str, job_class: str, owner: str,
           cost_per_step: float, num_inference_steps: int, ttl_seconds: int) -> None:
    """`settle` for one started job: its estimated seconds (``cost_per_step`` times its steps)
    are charged to its user."""
    record = ChargeRecord.of(owner=owner, job_class=job_class, cost_per_step=cost_per_step,
                             num_inference_steps=num_inference_steps)
    settle(redis, prefix, started=[(job_id, record)], ttl_seconds=ttl_seconds)


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
    reply = json.loads(_run(redis, "pick", prefix, model, repr(now), repr(aging_seconds),
                            num_queues, num_jobs, TOP_LEVEL, *(bases[c] for c in CLASSES)))
    jobs: list[QueuedJob] = []
    served: dict[tuple[str, str], float] = {}
    # An empty Lua table comes back as {}: iterating it yields nothing, as [] would.
    for queue in reply["queues"]:
        served[(queue["job_class"], queue["owner"])] = float(queue["served"])
        for job in queue["jobs"]:
            if job["meta"]:  # an id without its meta is mid-removal: skip it
                jobs.append(JobMeta.queued_job(job["meta"], job_id=job["id"],
                                               due=float(job["due"])))
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


def is_built(marker: str | bytes | None) -> bool:
    """Whether a ``P sched:built`` value marks an index built in this version's record format."""
    return marker is not None and _text(marker) == FORMAT


def _clear(redis: Redis, prefix: str) -> int:
    """Deletes, in one command, every key that holds records (`scheduler.records`) or that the
    records locate: job metas, per-user queues and heads, active counts, charges. Ready keys
    (job id -> due time), service, virtual times and learned costs hold no records and stay.
    Returns how many keys were deleted."""
    kinds = tuple(f"{prefix}sched:{kind}" for kind in ("q:", "u:", "charge:"))
    keys = [k for k in map(_text, redis.scan_iter(match=f"{prefix}sched:*", count=1000))
            if k.startswith(kinds)]
    keys += [jobs_key(prefix), *(active_key(prefix, c) for c in CLASSES)]
    return int(redis.delete(*keys))


def reconcile(session: Session, redis: Redis, prefix: str) -> Reconciled:
    """Makes the index hold exactly the queued jobs. Safe beside claims and submits: it adds only
    jobs the database says are queued and drops an entry only after re-reading its job.

    An index marked as built in another record format (an older version's) is cleared first
    (`_clear`), then filled; an unmarked one (a fresh or flushed Redis) holds only what this
    version's submits added. Clearing before the database is read keeps every queued job: one
    committed before the read is found by it, one committed after is added by its submitter.
    Started jobs lose their charge records: their users keep the estimates they were charged
    instead of the real render seconds."""
    marker = redis.get(built_key(prefix))
    if marker is not None and not is_built(marker):
        _clear(redis, prefix)
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
    redis.set(built_key(prefix), FORMAT)
    return Reconciled(added=added, removed=removed)


def ensure_built(session: Session, redis: Redis, prefix: str) -> None:
    """Builds the index from the database the first time any group needs it, and again when
    it was built in another record format (`reconcile`)."""
    if is_built(redis.get(built_key(prefix))):
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
