"""The claim protocol: make a `SchedulerOutput` real in Redis and the database, atomically per job.

A worker group with free ranks calls `claim_for_group` at a step boundary. It reads a bounded
set of candidates from the Redis index of queued jobs (`scheduler.queue_index`: the oldest jobs
of the few user queues that can win, never the whole queue), lets a `scheduler.policy.Policy`
choose, and claims every chosen job with `storage.lifecycle.claim_job`: one conditional UPDATE
(queued -> running with a fresh attempt token) committed with its event. Two groups may choose
the same job; the database lets exactly one of them have it, and the loser drops the job and
offers the rank to the next candidate. A job whose deadline has passed is ended as ``expired``
on the way, with the reason (`storage.lifecycle.expire`). Every job chosen leaves the index,
whatever the outcome of its claim.

Besides `scheduler.queue_index`'s keys this module keeps ``P + "sched:cost"``, the learned
`CostModel` (`scheduler.records.encode_costs`: the fits of every layout; a group reads and
teaches those of its own ``sp``), and charges each started job to its user
(``P sched:served:{class}``) until `record_result` replaces the estimate by the real render
seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime

from redis import Redis, RedisError, WatchError
from sqlalchemy.orm import Session

from common.families import family_of
from scheduler import queue_index
from scheduler.cost import CostModel, tokens
from scheduler.policy import INTERACTIVE, JobResult, Policy, PolicyConfig, QueuedJob, RunningJob
from scheduler.records import ChargeRecord, RecordError, decode_costs, encode_costs
from storage.lifecycle import Claim, claim_job, expire
from storage.outages import describe, is_outage
from storage.tables import Job, utcnow

log = logging.getLogger(__name__)

# A claim that loses a race (or meets an entry gone stale: a job cancelled while queued) frees
# its rank for another candidate, a few times at most; every round drops what it found.
MAX_ROUNDS = 8
# User queues read per call beyond one per free rank: slack for queues whose head job turns
# out stale or expired.
EXTRA_QUEUES = 2
CHARGE_TTL_SECONDS = 7 * 24 * 3600


def cost_key(prefix: str) -> str:
    return f"{prefix}sched:cost"


def job_tokens(job: Job) -> int:
    return tokens(job.width, job.height, job.num_frames, family=family_of(job.model))


def running_job(job: Job, *, rank: int, steps_done: int,
                costs: CostModel | None = None) -> RunningJob:
    """What a rank is rendering, as `claim_for_group` wants it in ``running``."""
    costs = costs or CostModel()
    return RunningJob(job_id=job.id, rank=rank, model=job.model,
                      cost_per_step=costs.step_seconds(job.model, job_tokens(job)),
                      steps_left=max(0, job.num_inference_steps - steps_done))


def load_costs(redis: Redis, prefix: str, sp: int = 1) -> CostModel:
    """The learned costs, as replicas of ``sp`` ranks pay them."""
    raw = redis.get(cost_key(prefix))
    return decode_costs(raw, sp=sp) if raw else CostModel(sp=sp)


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
    sp: int = 1,
    prefer: str = INTERACTIVE,
    job_class: str | None = None,
) -> list[tuple[int, Claim]]:
    """Pick up to len(free_ranks) compatible queued jobs for this group's free ranks and claim
    each atomically (storage.lifecycle.claim_job); returns (rank, Claim) pairs, by rank. Jobs whose
    deadline has passed are moved to `expired` on the way. Never returns a job another group
    claimed.

    ``running``: what the group's other ranks are still rendering; a ``cost_per_step`` of 0 is
    replaced by the estimate recorded when that job was claimed here. ``sp``: the group's ranks
    per replica; its steps are estimated from the costs learned at that layout. ``prefer``: the
    class of jobs the group takes first, "interactive" (the default) or "batch" (a throughput
    group: `scheduler.policy.GOAL_PREFERS`); it takes the other class's jobs when none of its own
    is due for its model, and aging lifts those in time as it lifts every waiting job.
    ``job_class``: claim only jobs of that class (a replica busy with batch work is offered
    interactive jobs only: `scheduler.turns.preempt_target`)."""
    now = now or utcnow()
    config = config or PolicyConfig()
    ranks = sorted(set(free_ranks))
    if not ranks:
        return []
    # One round trip for the bookkeeping every call needs.
    unknown = [r.job_id for r in running if not r.cost_per_step > 0]
    pipe = redis.pipeline(transaction=False)
    pipe.get(queue_index.built_key(prefix))
    pipe.get(cost_key(prefix))
    # MGET needs at least one key: with no unknown costs, a dummy whose reply zip() ignores.
    pipe.mget([queue_index.charge_key(prefix, i) for i in unknown]
              or [queue_index.charge_key(prefix, "")])
    built, raw_costs, charges = pipe.execute()
    if not queue_index.is_built(built):
        queue_index.ensure_built(session, redis, prefix)
    costs = decode_costs(raw_costs, sp=sp) if raw_costs else CostModel(sp=sp)
    claimed: dict[int, Claim] = {}
    busy = _with_costs(running, dict(zip(unknown, charges, strict=False)))
    try:
        _claim_rounds(session, redis, prefix, group_id, model, ranks, claimed, busy, costs,
                      config, lease_seconds, now, prefer, job_class)
    except Exception as exc:
        if not (claimed and is_outage(exc)):
            raise
        # The claims made so far are committed: their ranks start them; the rest waits for the
        # server to come back.
        log.warning("claimed %d job(s), then: %s", len(claimed), describe(exc))
    return sorted(claimed.items(), key=lambda rc: rc[0])


def _claim_rounds(session: Session, redis: Redis, prefix: str, group_id: str, model: str,
                  ranks: list[int], claimed: dict[int, Claim], busy: list[RunningJob],
                  costs: CostModel, config: PolicyConfig, lease_seconds: float,
                  now: datetime, prefer: str, job_class: str | None = None) -> None:
    """Rounds of pick, schedule and claim until every rank in ``ranks`` is in ``claimed`` or no
    candidate is left; ``claimed`` and ``busy`` grow as it goes."""
    for _ in range(MAX_ROUNDS):
        want = [r for r in ranks if r not in claimed]
        if not want:
            break
        policy, loaded = candidates(redis, prefix, model, now.timestamp(), len(want), costs,
                                    config, prefer, job_class)
        plan = policy.schedule(want, model=model, running=busy, now=now.timestamp(),
                               prefer=prefer)
        for job_id in plan.expired:
            expire(session, job_id, now=now)
        started = []
        for rank, job_id in plan.assignments.items():
            job = loaded[job_id]
            claim = claim_job(session, job_id, worker_group_id=group_id, rank=rank,
                              lease_seconds=lease_seconds, now=now)
            if claim is None:  # taken by another group, cancelled, or otherwise not queued
                continue
            claimed[rank] = claim
            started.append(job)
            busy.append(RunningJob(job_id=job_id, rank=rank, model=model,
                                   cost_per_step=plan.step_costs[job_id],
                                   steps_left=job.num_inference_steps))
        _settle(redis, prefix, started, plan.step_costs,
                [loaded[i] for i in [*plan.expired, *plan.assignments.values()]])
        if not plan.assignments and not plan.expired:
            break


def _with_costs(running: Sequence[RunningJob],
                charges: dict[str, bytes | str | None]) -> list[RunningJob]:
    """``running``, with the cost recorded at claim time wherever the caller passed none."""
    known = {job_id: charge.cost_per_step for job_id, raw in charges.items()
             if (charge := _charge(raw)) is not None}
    return [RunningJob(job_id=r.job_id, rank=r.rank, model=r.model,
                       cost_per_step=known.get(r.job_id, r.cost_per_step),
                       steps_left=r.steps_left) if r.job_id in known else r for r in running]


def _charge(raw: bytes | str | None) -> ChargeRecord | None:
    """A ``P sched:charge:{job}`` value; None for none, or for one of another record format (a
    job started before an upgrade: its user keeps the estimate it was charged)."""
    if raw is None:
        return None
    try:
        return ChargeRecord.decode(raw)
    except RecordError:
        log.warning("ignoring a charge record of another format: %r", raw)
        return None


def candidates(redis: Redis, prefix: str, model: str, now: float, num_free: int,
               costs: CostModel, config: PolicyConfig,
               prefer: str = INTERACTIVE, job_class: str | None = None,
               ) -> tuple[Policy, dict[str, QueuedJob]]:
    """A throwaway policy holding just the jobs that can win ``num_free`` ranks.

    The policy takes the highest level, then the least-served user (oldest due at the top
    level), then one of that user's ``cost_window`` oldest jobs; after each pick the picked
    user's service grows. So the winners of ``num_free`` picks all come from the first
    ``num_free`` user queues in that order, and from their ``cost_window + num_free`` oldest
    jobs: that, plus a little slack, is all that is read (`scheduler.queue_index.pick`).
    Levels are those of a group that prefers the class ``prefer``, in the pick as in the policy.
    ``job_class``: only that class's jobs are candidates (those of the other class that the
    pick returns are left in the queue).
    """
    jobs, served = queue_index.pick(redis, prefix, model, now=now,
                                    aging_seconds=config.aging_seconds,
                                    num_queues=num_free + EXTRA_QUEUES,
                                    num_jobs=config.cost_window + num_free, prefer=prefer)
    if job_class is not None:
        jobs = [j for j in jobs if j.job_class == job_class]
    policy = Policy(config, costs)
    policy.add_many(jobs)
    for (job_class, owner), value in served.items():
        policy.set_served(job_class, owner, value)
    return policy, {j.job_id: j for j in jobs}


def _settle(redis: Redis, prefix: str, started: Sequence[QueuedJob],
            step_costs: dict[str, float], done: Sequence[QueuedJob]) -> None:
    """One round trip: charge the started jobs to their users, and drop every job the plan
    touched (started, lost to another group, expired) from the index."""
    if not done:
        return
    try:
        _settle_now(redis, prefix, started, step_costs, done)
    except RedisError:
        # The claims stand (the database is the truth); the index drops these entries when it
        # meets them again or at the next reconcile, and the charges are lost.
        log.warning("Redis unavailable after claiming %s", [j.job_id for j in done],
                    exc_info=True)


def _settle_now(redis: Redis, prefix: str, started: Sequence[QueuedJob],
                step_costs: dict[str, float], done: Sequence[QueuedJob]) -> None:
    charges = [(job.job_id, ChargeRecord.of(owner=job.owner, job_class=job.job_class,
                                            cost_per_step=step_costs[job.job_id],
                                            num_inference_steps=job.num_inference_steps))
               for job in started]
    queue_index.settle(redis, prefix, started=charges, done=[j.job_id for j in done],
                       ttl_seconds=CHARGE_TTL_SECONDS)


def record_result(redis: Redis, *, prefix: str, job_id: str, model: str, num_tokens: int,
                  num_inference_steps: int, render_seconds: float, sp: int = 1) -> None:
    """A finished attempt's real cost: teaches the cost model seconds per step for its size and
    replaces the estimate its user was charged by the real render seconds. Pass the rank's own
    compute time for the steps where it is measured: a lock-step group's wall time includes
    waiting for the slowest rank. ``sp``: the ranks per replica it rendered on; the fit of that
    layout learns from it."""
    result = JobResult(job_id=job_id, model=model, num_tokens=num_tokens,
                       num_inference_steps=num_inference_steps, render_seconds=render_seconds)
    charged = _charge(redis.getdel(queue_index.charge_key(prefix, job_id)))
    if charged is not None:
        redis.hincrbyfloat(queue_index.served_key(prefix, charged.job_class), charged.owner,
                           render_seconds - charged.charged_seconds)
    if result.num_inference_steps <= 0:
        return
    key = cost_key(prefix)
    # Optimistic update: two groups finishing at once both land, one after a retry.
    for _ in range(10):
        with redis.pipeline() as pipe:
            try:
                pipe.watch(key)
                raw_cost = pipe.get(key)
                costs = decode_costs(raw_cost, sp=sp) if raw_cost else CostModel(sp=sp)
                costs.observe(model, num_tokens, render_seconds / num_inference_steps)
                pipe.multi()
                pipe.set(key, encode_costs(costs))
                pipe.execute()
                return
            except WatchError:
                continue
