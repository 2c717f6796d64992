"""The claim protocol on SQLite and PostgreSQL with real Redis: plans become claims atomically."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler import claim as sched
from scheduler import queue_index
from scheduler.policy import RunningJob
from scheduler.records import FORMAT, JobMeta, RecordError, encode_costs
from storage import lifecycle, queries, submission
from storage.submission import JobSpec
from storage.tables import Job, JobClass, JobState, User
from storage.users import get_or_create_user

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def user(session: Session, name: str) -> User:
    u = get_or_create_user(session, name)
    session.commit()
    return u


def submit(session: Session, r: redis.Redis, prefix: str, owner: User, *, now: datetime = T0,
           **overrides: object) -> Job:
    fields: dict[str, object] = dict(
        model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9, fps=8,
        num_inference_steps=4, guidance_scale=5.0, seed=1,
    )
    fields.update(overrides)
    job = submission.create_job(session, owner, JobSpec(**fields), request_hash="h",  # type: ignore[arg-type]
                                now=now).job
    queue_index.add(r, prefix, [job])
    return job


def claim(session: Session, r: redis.Redis, prefix: str, ranks: list[int], *, group: str = "g1",
          model: str = "kiln-tiny", now: datetime = T0 + timedelta(seconds=1),
          running: list[RunningJob] | None = None,
          prefer: str | None = None) -> list[tuple[int, lifecycle.Claim]]:
    # ``prefer`` only when given: the claim's own default is what most tests exercise.
    chosen = {} if prefer is None else {"prefer": prefer}
    return sched.claim_for_group(session, r, prefix=prefix, group_id=group, model=model,
                                 free_ranks=ranks, running=running or [], lease_seconds=60,
                                 now=now, **chosen)


def test_claims_one_job_per_free_rank_in_priority_order_and_clears_their_ready_entries(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    low = submit(session, redis_client, redis_prefix, alice, priority=1)
    batch = submit(session, redis_client, redis_prefix, alice, job_class=JobClass.BATCH,
                   priority=9)
    high = submit(session, redis_client, redis_prefix, alice, priority=8)
    got = claim(session, redis_client, redis_prefix, [0, 1])
    assert [(rank, c.job.id) for rank, c in got] == [(0, high.id), (1, low.id)]
    rows = {j.id: j for j in session.scalars(select(Job))}
    assert rows[high.id].state == "running" and rows[high.id].worker_group_id == "g1"
    assert rows[high.id].rank == 0 and rows[low.id].rank == 1
    assert rows[batch.id].state == "queued"
    assert queue_index.position(redis_client, redis_prefix, high) is None
    assert queue_index.position(redis_client, redis_prefix, batch) == 0


def test_only_jobs_of_the_groups_model_are_claimed(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    big = submit(session, redis_client, redis_prefix, alice, model="kiln-big")
    assert claim(session, redis_client, redis_prefix, [0, 1]) == []
    got = claim(session, redis_client, redis_prefix, [0, 1], model="kiln-big")
    assert [(rank, c.job.id) for rank, c in got] == [(0, big.id)]


def test_a_job_past_its_deadline_ends_expired_with_the_reason_and_is_not_claimed(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    late = submit(session, redis_client, redis_prefix, alice, deadline=T0 + timedelta(seconds=30))
    ok = submit(session, redis_client, redis_prefix, alice)
    got = claim(session, redis_client, redis_prefix, [0, 1], now=T0 + timedelta(seconds=31))
    assert [c.job.id for _, c in got] == [ok.id]
    session.expire_all()
    row = session.get(Job, late.id)
    assert row is not None and row.state == JobState.EXPIRED
    assert row.error_code == "expired" and "deadline passed" in (row.error or "")
    assert [e.kind for e in queries.job_events(session, late.id)] == ["created", "expired"]
    assert queue_index.position(redis_client, redis_prefix, late) is None


def test_a_job_waits_for_its_not_before(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    later = submit(session, redis_client, redis_prefix, alice,
                   not_before=T0 + timedelta(hours=1))
    assert claim(session, redis_client, redis_prefix, [0]) == []
    got = claim(session, redis_client, redis_prefix, [0], now=T0 + timedelta(hours=1))
    assert [c.job.id for _, c in got] == [later.id]


def test_a_stale_entry_is_dropped_and_its_rank_goes_to_the_next_job(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    first = submit(session, redis_client, redis_prefix, alice, priority=9)
    second = submit(session, redis_client, redis_prefix, alice, priority=1)
    queue_index.ensure_built(session, redis_client, redis_prefix)
    assert redis_client.hlen(queue_index.jobs_key(redis_prefix)) == 2
    # Claimed behind the index's back (another group that has not cleaned up yet).
    assert lifecycle.claim_job(session, first.id, worker_group_id="other", lease_seconds=60,
                               now=T0) is not None
    got = claim(session, redis_client, redis_prefix, [0])
    assert [c.job.id for _, c in got] == [second.id]
    assert redis_client.zcard(queue_index.ready_key(redis_prefix, "interactive", 9)) == 0
    assert redis_client.hlen(queue_index.jobs_key(redis_prefix)) == 0


def test_two_groups_claiming_at_once_never_get_the_same_job(
    db: object, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    with db.session() as s:  # type: ignore[attr-defined]
        owners = [user(s, f"u{i}") for i in range(3)]
        ids = {submit(s, redis_client, redis_prefix, owners[i % 3]).id for i in range(24)}
    got: dict[str, list[str]] = {"g1": [], "g2": []}

    def work(group: str) -> None:
        with db.session() as s:  # type: ignore[attr-defined]
            while True:
                claims = claim(s, redis_client, redis_prefix, [0, 1], group=group)
                if not claims:
                    return
                got[group].extend(c.job.id for _, c in claims)

    threads = [threading.Thread(target=work, args=(g,)) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(got["g1"]) & set(got["g2"])
    assert sorted(got["g1"] + got["g2"]) == sorted(ids)


def test_record_result_teaches_the_cost_model_and_corrects_the_users_charge(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    submit(session, redis_client, redis_prefix, alice, num_inference_steps=4)
    [(_, c)] = claim(session, redis_client, redis_prefix, [0])
    served = redis_client.hget(queue_index.served_key(redis_prefix, "interactive"), str(alice.id))
    assert served is not None and float(served) > 0
    sched.record_result(redis_client, prefix=redis_prefix, job_id=c.job.id, model="kiln-tiny",
                        num_tokens=48, num_inference_steps=4, render_seconds=2.0)
    served = redis_client.hget(queue_index.served_key(redis_prefix, "interactive"), str(alice.id))
    assert served is not None and abs(float(served) - 2.0) < 1e-9
    costs = sched.load_costs(redis_client, redis_prefix)
    assert abs(costs.step_seconds("kiln-tiny", 48) - 0.5) < 1e-9


def test_another_users_few_jobs_are_not_held_back_by_one_users_thousands(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice, bob = user(session, "alice"), user(session, "bob")
    for _ in range(60):
        submit(session, redis_client, redis_prefix, alice, job_class=JobClass.BATCH)
    bobs = {submit(session, redis_client, redis_prefix, bob, job_class=JobClass.BATCH,
                   now=T0 + timedelta(seconds=1)).id for _ in range(3)}
    order: list[str] = []
    for _ in range(4):
        order += [c.job.id for _, c in claim(session, redis_client, redis_prefix, [0, 1],
                                             now=T0 + timedelta(seconds=2))]
    # Bob's 3 jobs alternate with Alice's from the start instead of waiting behind 60.
    assert bobs <= set(order[:6])


def test_the_index_holds_only_queued_jobs_and_is_empty_once_they_are_claimed(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    ids = [submit(session, redis_client, redis_prefix, alice).id for _ in range(5)]
    cancelled = submit(session, redis_client, redis_prefix, alice)
    queue_index.ensure_built(session, redis_client, redis_prefix)
    assert lifecycle.request_cancel(session, cancelled.id, alice) is not None
    assert queue_index.reconcile(session, redis_client, redis_prefix) == queue_index.Reconciled(
        added=0, removed=1)
    got: list[str] = []
    while claims := claim(session, redis_client, redis_prefix, [0, 1]):
        got += [c.job.id for _, c in claims]
    assert sorted(got) == sorted(ids)
    left = {k.split(":", 2)[2] for k in queue_index.index_keys(redis_client, redis_prefix)}
    # Only per-class accounting and markers remain: no queue, head or job entry.
    assert left <= {"sched:built", "sched:served:interactive", "sched:vtime:interactive"} | {
        f"sched:charge:{i}" for i in ids}


def test_a_requeued_job_is_indexed_again_and_claimed(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    job = submit(session, redis_client, redis_prefix, alice)
    [(_, first)] = claim(session, redis_client, redis_prefix, [0])
    assert lifecycle.fail_job(session, job.id, first.attempt_token, error="worker lost",
                              retryable=True) == JobState.QUEUED
    queue_index.add(redis_client, redis_prefix, [session.get(Job, job.id)])  # type: ignore[list-item]
    [(_, second)] = claim(session, redis_client, redis_prefix, [1])
    assert second.job.id == job.id and second.attempt_token != first.attempt_token


def test_a_free_rank_gets_the_job_closest_in_step_cost_to_what_the_other_rank_runs(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    first_big = submit(session, redis_client, redis_prefix, alice, width=256, height=256)
    submit(session, redis_client, redis_prefix, alice, now=T0 + timedelta(seconds=1))  # small
    big = submit(session, redis_client, redis_prefix, alice, width=256, height=256,
                 now=T0 + timedelta(seconds=2))
    [(_, c)] = claim(session, redis_client, redis_prefix, [0], now=T0 + timedelta(seconds=3))
    assert c.job.id == first_big.id
    # The worker does not know costs: 0 means "the one recorded at claim time".
    running = [RunningJob(job_id=first_big.id, rank=0, model="kiln-tiny", cost_per_step=0.0,
                          steps_left=3)]
    [(rank, c)] = claim(session, redis_client, redis_prefix, [1], running=running,
                        now=T0 + timedelta(seconds=3))
    assert (rank, c.job.id) == (1, big.id)  # not the older small one


def test_a_flushed_redis_is_rebuilt_from_the_database_by_the_next_claim(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    low = submit(session, redis_client, redis_prefix, alice, priority=1)
    high = submit(session, redis_client, redis_prefix, alice, priority=8)
    redis_client.delete(*redis_client.scan_iter(match=f"{redis_prefix}*"))
    assert queue_index.position(redis_client, redis_prefix, low) is None
    got = claim(session, redis_client, redis_prefix, [0])
    assert [c.job.id for _, c in got] == [high.id]
    assert queue_index.position(redis_client, redis_prefix, low) == 0
    assert redis_client.hkeys(queue_index.jobs_key(redis_prefix)) == [low.id.encode()]


def _index_in_format_1(r: redis.Redis, prefix: str, job: Job) -> None:
    """What the version before named records stored for a queued job: positional JSON lists."""
    q = queue_index.queue_name(job.model, job.class_, job.priority)
    due = queue_index.due(job)
    r.zadd(queue_index.ready_key(prefix, job.class_, job.priority), {job.id: due})
    r.hset(queue_index.jobs_key(prefix), job.id, json.dumps(
        [q, str(job.owner_id), job.class_, job.priority, 48, job.num_inference_steps, None,
         job.model]))
    r.zadd(queue_index.queue_key(prefix, job.model, job.class_, job.priority, str(job.owner_id)),
           {job.id: due})
    r.zadd(queue_index.users_key(prefix, job.model, job.class_, job.priority),
           {str(job.owner_id): due})
    r.hincrby(queue_index.active_key(prefix, job.class_), str(job.owner_id), 1)


def test_an_index_of_an_older_record_format_is_cleared_and_rebuilt_by_the_next_claim(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    spec = JobSpec(model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9,
                   fps=8, num_inference_steps=4, guidance_scale=5.0, seed=1)
    first, second = (submission.create_job(session, alice, spec, request_hash="h",
                                           now=T0 + timedelta(seconds=i)).job for i in (0, 1))
    for job in (first, second):
        _index_in_format_1(redis_client, redis_prefix, job)
    old_charge = queue_index.charge_key(redis_prefix, "started-before")
    redis_client.set(old_charge, json.dumps(["interactive", str(alice.id), 2.0, 0.5]))
    redis_client.hset(queue_index.served_key(redis_prefix, "interactive"), str(alice.id), 7.0)
    costs = sched.CostModel()
    costs.observe("kiln-big", 48, 3.0)  # a model this claim does not teach
    redis_client.set(sched.cost_key(redis_prefix), encode_costs(costs))
    redis_client.set(queue_index.built_key(redis_prefix), "1")
    with pytest.raises(RecordError):  # what reading it as it is would do
        queue_index.pick(redis_client, redis_prefix, "kiln-tiny", now=T0.timestamp() + 5,
                         aging_seconds=600, num_queues=1, num_jobs=1)

    [(_, got)] = claim(session, redis_client, redis_prefix, [0], now=T0 + timedelta(seconds=5))
    assert got.job.id == first.id
    assert redis_client.get(queue_index.built_key(redis_prefix)) == FORMAT.encode()
    assert redis_client.exists(old_charge) == 0
    assert JobMeta.decode(redis_client.hget(queue_index.jobs_key(redis_prefix), second.id)) == \
        JobMeta(owner=str(alice.id), model="kiln-tiny", job_class="interactive", priority=5,
                num_tokens=sched.job_tokens(second), num_inference_steps=4, deadline=None)
    assert queue_index.position(redis_client, redis_prefix, second) == 0
    # Service and learned costs are no index records: they stay (the claim charged alice on top
    # of what she had).
    assert float(redis_client.hget(queue_index.served_key(redis_prefix, "interactive"),
                                   str(alice.id))) > 7.0
    assert sched.load_costs(redis_client, redis_prefix).step_seconds("kiln-big", 48) == 3.0
    assert queue_index.reconcile(session, redis_client, redis_prefix) == queue_index.Reconciled(
        added=0, removed=0)


def test_reconcile_puts_back_a_queue_position_lost_from_redis(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    first = submit(session, redis_client, redis_prefix, alice)
    second = submit(session, redis_client, redis_prefix, alice, now=T0 + timedelta(seconds=1))
    redis_client.zrem(queue_index.ready_key(redis_prefix, "interactive", 5), first.id)
    assert queue_index.position(redis_client, redis_prefix, first) is None
    assert queue_index.reconcile(session, redis_client, redis_prefix) == queue_index.Reconciled(
        added=0, removed=0)
    assert queue_index.position(redis_client, redis_prefix, first) == 0
    assert queue_index.position(redis_client, redis_prefix, second) == 1


# -- pools by goal: a latency group prefers interactive jobs, a throughput group batch jobs ------

def test_with_both_classes_queued_each_goal_claims_its_own_class_first(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice, bob = user(session, "alice"), user(session, "bob")
    fast = [submit(session, redis_client, redis_prefix, owner, priority=0,
                   now=T0 + timedelta(milliseconds=i)) for i, owner in enumerate([alice, bob])]
    night = [submit(session, redis_client, redis_prefix, owner, job_class=JobClass.BATCH,
                    priority=9, now=T0 + timedelta(milliseconds=10 + i))
             for i, owner in enumerate([alice, bob])]
    # A throughput group (batch first: class before priority, as for interactive work) ...
    got = claim(session, redis_client, redis_prefix, [0, 1], group="dp", prefer="batch")
    assert sorted(c.job.id for _, c in got) == sorted(j.id for j in night)
    assert {c.job.class_ for _, c in got} == {"batch"}
    # ... and a latency group, whose preference is the claim's default.
    got = claim(session, redis_client, redis_prefix, [0], group="sp", prefer="interactive")
    assert [c.job.id for _, c in got] == [fast[0].id]
    got = claim(session, redis_client, redis_prefix, [0], group="sp2")
    assert [c.job.id for _, c in got] == [fast[1].id]
    groups = {j.id: j.worker_group_id for j in session.scalars(select(Job))}
    assert groups == {night[0].id: "dp", night[1].id: "dp", fast[0].id: "sp",
                      fast[1].id: "sp2"}


def test_each_goal_takes_the_other_class_when_none_of_its_own_is_queued(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    fast = submit(session, redis_client, redis_prefix, alice)
    got = claim(session, redis_client, redis_prefix, [0, 1], group="dp", prefer="batch")
    assert [(rank, c.job.id) for rank, c in got] == [(0, fast.id)]
    night = submit(session, redis_client, redis_prefix, alice, job_class=JobClass.BATCH)
    got = claim(session, redis_client, redis_prefix, [0], group="sp", prefer="interactive")
    assert [c.job.id for _, c in got] == [night.id]


def test_a_throughput_group_fills_its_free_ranks_with_batch_then_interactive_work(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    # More interactive users than one claim reads queues for (one per free rank plus two): the
    # Redis pick itself must rank the batch queue first, not only the policy.
    owners = [user(session, name) for name in ("a", "b", "c", "d", "e")]
    fast = [submit(session, redis_client, redis_prefix, o, priority=9,
                   now=T0 + timedelta(milliseconds=i)) for i, o in enumerate(owners)]
    night = submit(session, redis_client, redis_prefix, user(session, "owl"),
                   job_class=JobClass.BATCH, priority=0, now=T0 + timedelta(seconds=0.5))
    got = claim(session, redis_client, redis_prefix, [0, 1], prefer="batch")
    assert [(rank, c.job.id) for rank, c in got] == [(0, night.id), (1, fast[0].id)]


def test_a_batch_job_not_yet_in_its_window_leaves_a_throughput_group_to_interactive_work(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    alice = user(session, "alice")
    opens = T0 + timedelta(hours=8)  # an overnight window
    night = submit(session, redis_client, redis_prefix, alice, job_class=JobClass.BATCH,
                   not_before=opens)
    fast = submit(session, redis_client, redis_prefix, alice)
    got = claim(session, redis_client, redis_prefix, [0], prefer="batch")
    assert [c.job.id for _, c in got] == [fast.id]
    assert claim(session, redis_client, redis_prefix, [0], prefer="batch") == []
    # Once the window opens the batch job is due, and a latency group with no interactive work
    # takes it as well.
    got = claim(session, redis_client, redis_prefix, [0], group="sp", prefer="interactive",
                now=opens)
    assert [c.job.id for _, c in got] == [night.id]


def test_an_unknown_preference_is_refused(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    submit(session, redis_client, redis_prefix, user(session, "alice"))
    with pytest.raises(ValueError, match="prefer"):
        claim(session, redis_client, redis_prefix, [0], prefer="overnight")
