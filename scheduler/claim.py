"""The claim protocol: make a `Plan` real against Redis and the database, atomically per job.

A worker group with free ranks calls `claim_for_group` at a step boundary. It reads a bounded
set of candidates from the Redis ready index, lets a `scheduler.policy.Policy` choose, and claims
every chosen job with `storage.jobs.claim_job`: one conditional UPDATE (queued -> running with a
fresh attempt token) committed with its event. Two groups may choose the same job; the database
lets exactly one of them have it, and the loser drops the job and offers the rank to the next
candidate. A job whose deadline has passed is ended as ``expired`` on the way, with the reason.

Redis keys this module owns (``P`` is ``Settings.redis_prefix``), next to the ready index of
``storage.ready``:

- ``P + "sched:served:{class}"``: hash, user id -> service in estimated render seconds (fairness).
- ``P + "sched:charge:{job id}"``: what a started job was charged, until `record_result`
  replaces it by its real cost (expires after ``CHARGE_TTL_SECONDS`` if no result ever comes).
- ``P + "sched:cost"``: the learned `CostModel` as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from redis import Redis, WatchError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from scheduler.cost import CostModel, tokens
from scheduler.policy import JobResult, Policy, PolicyConfig, QueuedJob, RunningJob
from storage.jobs import Claim, claim_job
from storage.models import Job, JobEvent, JobState, utcnow
from storage.ready import ready_key, ready_keys

# Entries read from the head of each ready key per call: bounds the work of one claim.
HEAD = 64
# A claim that loses a race frees its rank for another candidate, a few times at most.
MAX_ROUNDS = 3
CHARGE_TTL_SECONDS = 7 * 24 * 3600
EXPIRED_ERROR = "its deadline passed before it could start"

_COLUMNS = (Job.id, Job.owner_id, Job.model, Job.class_, Job.priority, Job.width, Job.height,
            Job.num_frames, Job.num_inference_steps, Job.created_at, Job.not_before,
            Job.deadline, Job.state)


def served_key(prefix: str, job_class: str) -> str:
    return f"{prefix}sched:served:{job_class}"


def charge_key(prefix: str, job_id: str) -> str:
    return f"{prefix}sched:charge:{job_id}"


def cost_key(prefix: str) -> str:
    return f"{prefix}sched:cost"


def job_tokens(job: Job) -> int:
    return tokens(job.width, job.height, job.num_frames)


def running_job(job: Job, *, rank: int, steps_done: int,
                costs: CostModel | None = None) -> RunningJob:
    """What a rank is rendering, as `claim_for_group` wants it in ``running``."""
    costs = costs or CostModel()
    return RunningJob(job_id=job.id, rank=rank, model=job.model,
                      cost_per_step=costs.step_seconds(job.model, job_tokens(job)),
                      steps_left=max(0, job.num_inference_steps - steps_done))


def load_costs(redis: Redis, prefix: str) -> CostModel:
    raw = redis.get(cost_key(prefix))
    return CostModel.from_state(json.loads(raw)) if raw else CostModel()


def claim_for_group(
    session: Session,
    redis: Redis,
    *,
    prefix: str,
    group_id: str,
    model: str,
    free_ranks: Sequence[int],
    running: Sequence[RunningJob] = (),
    lease_seconds: float,
    now: datetime | None = None,
    config: PolicyConfig | None = None,
) -> list[tuple[int, Claim]]:
    """Pick up to len(free_ranks) compatible queued jobs for this group's free ranks and claim
    each atomically (storage.jobs.claim_job); returns (rank, Claim) pairs, by rank. Jobs whose
    deadline has passed are moved to `expired` on the way. Never returns a job another group
    claimed."""
    now = now or utcnow()
    ranks = sorted(set(free_ranks))
    if not ranks:
        return []
    costs = load_costs(redis, prefix)
    claimed: dict[int, Claim] = {}
    busy = list(running)
    for _ in range(MAX_ROUNDS):
        want = [r for r in ranks if r not in claimed]
        if not want:
            break
        policy, rows = _candidates(session, redis, prefix, model, now, costs, config)
        plan = policy.schedule(want, model=model, running=busy, now=now.timestamp())
        for job_id in plan.expired:
            row = rows[job_id]
            expire_job(session, job_id, now=now)
            redis.zrem(ready_key(prefix, row.class_, row.priority), job_id)
        if not plan.assignments:
            break
        for rank, job_id in plan.assignments.items():
            row = rows[job_id]
            claim = claim_job(session, job_id, worker_group_id=group_id, rank=rank,
                              lease_seconds=lease_seconds, now=now)
            # Whatever the outcome the entry is done: claimed here, or not claimable at all.
            redis.zrem(ready_key(prefix, row.class_, row.priority), job_id)
            if claim is None:
                continue
            claimed[rank] = claim
            estimate = plan.step_costs[job_id] * row.num_inference_steps
            _charge(redis, prefix, job_id, row.class_, str(row.owner_id), estimate)
            busy.append(RunningJob(job_id=job_id, rank=rank, model=model,
                                   cost_per_step=plan.step_costs[job_id],
                                   steps_left=row.num_inference_steps))
    return sorted(claimed.items(), key=lambda rc: rc[0])


def _candidates(session: Session, redis: Redis, prefix: str, model: str, now: datetime,
                costs: CostModel, config: PolicyConfig | None) -> tuple[Policy, dict[str, Any]]:
    """A throwaway policy holding the due heads of the ready keys (``HEAD`` of each)."""
    keys = ready_keys(prefix)
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.zrangebyscore(key, "-inf", now.timestamp(), start=0, num=HEAD)
    ids_per_key = pipe.execute()
    ids = {(m.decode() if isinstance(m, bytes) else m): key
           for key, members in zip(keys, ids_per_key, strict=True) for m in members}
    rows: dict[str, Any] = {}
    if ids:
        for row in session.execute(select(*_COLUMNS).where(Job.id.in_(list(ids)))):
            rows[row.id] = row
        session.rollback()  # end the read transaction before the claims write
    stale = [i for i in ids if i not in rows or rows[i].state != JobState.QUEUED]
    if stale:
        pipe = redis.pipeline(transaction=False)
        for job_id in stale:
            pipe.zrem(ids[job_id], job_id)
        pipe.execute()
    policy = Policy(config, costs)
    owners: set[tuple[str, str]] = set()
    for r in rows.values():
        if r.state != JobState.QUEUED or r.model != model:
            continue
        policy.add(queued_job(r))
        owners.add((r.class_, str(r.owner_id)))
    _load_served(redis, prefix, policy, owners)
    return policy, rows


def queued_job(r: Any) -> QueuedJob:
    """A `QueuedJob` from a job row (a `Job`, or a row with the same attributes)."""
    due = max(r.not_before or r.created_at, r.created_at)
    return QueuedJob(
        job_id=r.id, owner=str(r.owner_id), model=r.model, job_class=r.class_,
        priority=r.priority, due=due.timestamp(),
        deadline=r.deadline.timestamp() if r.deadline is not None else None,
        num_tokens=tokens(r.width, r.height, r.num_frames), num_steps=r.num_inference_steps,
    )


def _load_served(redis: Redis, prefix: str, policy: Policy, shares: set[tuple[str, str]]) -> None:
    if not shares:
        return
    order = sorted(shares)
    pipe = redis.pipeline(transaction=False)
    for job_class, owner in order:
        pipe.hget(served_key(prefix, job_class), owner)
    for (job_class, owner), value in zip(order, pipe.execute(), strict=True):
        policy.set_served(job_class, owner, float(value) if value is not None else 0.0)


def _charge(redis: Redis, prefix: str, job_id: str, job_class: str, owner: str,
            estimate: float) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.hincrbyfloat(served_key(prefix, job_class), owner, estimate)
    pipe.set(charge_key(prefix, job_id), json.dumps([job_class, owner, estimate]),
             ex=CHARGE_TTL_SECONDS)
    pipe.execute()


def expire_job(session: Session, job_id: str, *, now: datetime | None = None) -> bool:
    """queued -> expired if its deadline has passed; commits. False if it was not (any more)."""
    now = now or utcnow()
    attempts = session.scalar(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.QUEUED, Job.deadline.is_not(None),
               Job.deadline <= now)
        .values(state=JobState.EXPIRED.value, finished_at=now, error=EXPIRED_ERROR,
                error_code="expired")
        .returning(Job.attempts)
        .execution_options(synchronize_session=False)
    )
    if attempts is None:
        session.rollback()
        return False
    session.add(JobEvent(job_id=job_id, at=now, kind="expired", attempt=attempts, detail={}))
    session.commit()
    return True


def record_result(redis: Redis, *, prefix: str, job_id: str, model: str, num_tokens: int,
                  num_steps: int, render_seconds: float) -> None:
    """A finished attempt's real cost: teaches the cost model seconds per step for its size and
    replaces the estimate its user was charged by the real render seconds."""
    result = JobResult(job_id=job_id, model=model, num_tokens=num_tokens, num_steps=num_steps,
                       render_seconds=render_seconds)
    raw = redis.getdel(charge_key(prefix, job_id))
    if raw is not None:
        job_class, owner, estimate = json.loads(raw)
        redis.hincrbyfloat(served_key(prefix, job_class), owner, render_seconds - estimate)
    if result.num_steps <= 0:
        return
    key = cost_key(prefix)
    # Optimistic update: two groups finishing at once both land, one after a retry.
    for _ in range(10):
        with redis.pipeline() as pipe:
            try:
                pipe.watch(key)
                raw_cost = pipe.get(key)
                costs = CostModel.from_state(json.loads(raw_cost)) if raw_cost else CostModel()
                costs.observe(model, num_tokens, render_seconds / num_steps)
                pipe.multi()
                pipe.set(key, json.dumps(costs.to_state()))
                pipe.execute()
                return
            except WatchError:
                continue
