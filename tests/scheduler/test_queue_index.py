"""The Redis index of queued jobs: one add puts a job where the queue position, the batcher's
pick and the wake-up read it; the bounded view a claim reads picks what the whole queue would."""

from __future__ import annotations

import itertools
import secrets
from datetime import UTC, datetime

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import queue_index
from scheduler.claim import candidates
from scheduler.cost import CostModel
from scheduler.policy import BATCH, INTERACTIVE, Policy, PolicyConfig, QueuedJob, RunningJob
from storage.tables import MAX_PRIORITY, MIN_PRIORITY, Job

_seq = itertools.count()
# More users than a claim reads queues for, so that picking the wrong ones would show.
OWNERS = [str(i) for i in range(10)]


def queued(owner: str, job_class: str, priority: int, due: float, num_tokens: int) -> QueuedJob:
    return QueuedJob(job_id=f"j{next(_seq)}", owner=owner, model="m", job_class=job_class,
                     priority=priority, due=due, num_tokens=num_tokens, num_inference_steps=4)


jobs_st = st.lists(
    # Few priorities, so that many users share a level and the fairness order decides.
    st.tuples(st.sampled_from([INTERACTIVE, BATCH]), st.sampled_from([5, 5, 5, 4]),
              st.sampled_from([48, 192, 768])),
    min_size=15, max_size=40)


@pytest.fixture
def clean_redis(redis_client: redis.Redis):
    """Redis with a fresh prefix per example (hypothesis reuses the function's fixtures)."""
    prefixes: list[str] = []

    def make() -> str:
        prefixes.append(f"kilntest:{secrets.token_hex(6)}:")
        return prefixes[-1]

    yield redis_client, make
    for prefix in prefixes:
        keys = list(redis_client.scan_iter(match=f"{prefix}*"))
        if keys:
            redis_client.delete(*keys)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=jobs_st, served=st.permutations(range(20)),
       num_free=st.integers(1, 3), aging=st.sampled_from([1e6, 40.0, 7.0]),
       big_running=st.booleans(), prefer=st.sampled_from([INTERACTIVE, BATCH]))
def test_the_claim_path_picks_what_a_policy_holding_the_whole_queue_picks(
    clean_redis: tuple[redis.Redis, object], specs: list[tuple[str, int, int]],
    served: list[int], num_free: int, aging: float, big_running: bool, prefer: str,
) -> None:
    r, make_prefix = clean_redis
    prefix = make_prefix()  # type: ignore[operator]
    # Distinct due times: ties would leave the order to insertion, which differs on purpose.
    # Owners in turn (hypothesis alone would mostly draw one), so many users share a band.
    jobs = [queued(OWNERS[i % len(OWNERS)], c, p, float(i * 3), t)
            for i, (c, p, t) in enumerate(specs)]
    now = float(len(jobs) * 3 + 10)
    shares = [(c, o) for c in (INTERACTIVE, BATCH) for o in OWNERS]
    config = PolicyConfig(aging_seconds=aging)
    costs = CostModel()
    running = [RunningJob(job_id="r", rank=9, model="m",
                          cost_per_step=costs.step_seconds("m", 768), steps_left=5)
               ] if big_running else []

    full = Policy(config, costs)
    full.add_many(jobs)
    for (c, o), s in zip(shares, served, strict=True):
        full.set_served(c, o, float(s))
    # ``prefer``: the class the group takes first (a latency group interactive, a throughput
    # group batch); the Redis pick must read the levels the policy then uses.
    expected = full.schedule(range(num_free), model="m", running=running, now=now,
                             prefer=prefer)

    assert queue_index.add(r, prefix, jobs) == len(jobs)
    for (c, o), s in zip(shares, served, strict=True):
        r.hset(queue_index.served_key(prefix, c), o, s)
    bounded, loaded = candidates(r, prefix, "m", now, num_free, costs, config, prefer)
    got = bounded.schedule(range(num_free), model="m", running=running, now=now, prefer=prefer)
    assert got.assignments == expected.assignments
    assert len(loaded) <= (num_free + 2) * (config.cost_window + num_free)


NOW = 1_000_000.0

# One queued job: owner, model, class, priority, seconds waited (negative: not due yet), tokens,
# steps, and a deadline after ``NOW`` or none. Mostly one priority and short waits, so that many
# users share a level and the fairness order decides; sometimes others, so that levels differ.
job_st = st.tuples(
    st.integers(0, 5), st.sampled_from(["m", "m", "m", "other"]),
    st.sampled_from([INTERACTIVE, BATCH]), st.sampled_from([5, 5, 5, 4, MIN_PRIORITY,
                                                            MAX_PRIORITY]),
    st.integers(-20, 100) | st.integers(-20, 1000), st.sampled_from([48, 192, 768]),
    st.sampled_from([4, 8, 16]), st.none() | st.floats(NOW + 1, NOW + 1e6))


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(job_st, min_size=1, max_size=30),
       served=st.lists(st.integers(0, 30), min_size=12, max_size=12),
       aging=st.sampled_from([1e6, 60.0, 13.0]),
       prefer=st.sampled_from([INTERACTIVE, BATCH]), num_picks=st.integers(1, 8))
def test_the_lua_pick_and_the_policy_pick_the_same_job_pick_after_pick(
    clean_redis: tuple[redis.Redis, object], specs: list[tuple], served: list[int],
    aging: float, prefer: str, num_picks: int,
) -> None:
    """The serving order is written twice, in `scheduler.policy` and in ``pick.lua``: for any
    queue, the first queue the script returns holds, as its oldest job, the job the policy
    starts; and so on after each start is charged to its user and the job leaves the index."""
    r, make_prefix = clean_redis
    prefix = make_prefix()  # type: ignore[operator]
    # Distinct due times (a thousandth apart at least): ties are left to insertion order in the
    # policy and to the job id in Redis.
    jobs = [QueuedJob(job_id=f"j{i}", owner=f"u{owner}", model=model, job_class=c, priority=prio,
                      due=NOW - waited + i / 1000, deadline=deadline, num_tokens=num_tokens,
                      num_inference_steps=steps)
            for i, (owner, model, c, prio, waited, num_tokens, steps, deadline)
            in enumerate(specs)]
    shares = [(c, f"u{o}") for c in (INTERACTIVE, BATCH) for o in range(6)]
    policy = Policy(PolicyConfig(aging_seconds=aging), CostModel())
    policy.add_many(jobs)
    assert queue_index.add(r, prefix, jobs) == len(jobs)
    for (c, o), s in zip(shares, served, strict=True):
        policy.set_served(c, o, float(s))
        r.hset(queue_index.served_key(prefix, c), o, s)

    by_id = {j.job_id: j for j in jobs}
    for _ in range(num_picks):
        service = {share: policy.served(*share) for share in shares}
        plan = policy.schedule([0], model="m", now=NOW, prefer=prefer)
        picked, picked_service = queue_index.pick(r, prefix, "m", now=NOW, aging_seconds=aging,
                                                  num_queues=1, num_jobs=1, prefer=prefer)
        if not plan.assignments:
            assert picked == []
            break
        job = by_id[plan.assignments[0]]
        assert picked == [job]  # every field read back from the JobMeta
        share = (job.job_class, job.owner)
        assert picked_service == {share: pytest.approx(service[share])}
        # What the claim does with a started job (`scheduler.claim._settle_now`).
        queue_index.charge(r, prefix, job_id=job.job_id, job_class=job.job_class,
                           owner=job.owner, cost_per_step=plan.step_costs[job.job_id],
                           num_inference_steps=job.num_inference_steps, ttl_seconds=60)
        assert queue_index.remove(r, prefix, [job.job_id]) == 1


def test_the_least_served_of_many_users_at_the_top_level_is_read_though_others_are_older(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    jobs = [queued(str(i), BATCH, 5, float(i), 48) for i in range(10)]
    queue_index.add(redis_client, redis_prefix, jobs)
    for i in range(10):
        redis_client.hset(queue_index.served_key(redis_prefix, BATCH), str(i), 100 - i)
    policy, loaded = candidates(redis_client, redis_prefix, "m", 100.0, 1, CostModel(),
                                PolicyConfig(aging_seconds=1e6))
    assert sorted(loaded) == sorted(j.job_id for j in jobs[-3:])  # users 9, 8, 7
    assert policy.schedule([0], model="m", now=100.0).assignments == {0: jobs[9].job_id}


def test_removing_a_users_head_moves_the_head_to_their_next_job(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    a1, a2 = queued("a", BATCH, 5, 10.0, 48), queued("a", BATCH, 5, 20.0, 48)
    queue_index.add(redis_client, redis_prefix, [a2, a1])
    heads = queue_index.users_key(redis_prefix, "m", BATCH, 5)
    assert redis_client.zscore(heads, "a") == 10.0
    assert queue_index.remove(redis_client, redis_prefix, [a1.job_id]) == 1
    assert redis_client.zscore(heads, "a") == 20.0
    assert queue_index.remove(redis_client, redis_prefix, [a2.job_id, "unknown"]) == 1
    assert redis_client.exists(heads) == 0
    assert redis_client.hlen(queue_index.jobs_key(redis_prefix)) == 0
    assert redis_client.hlen(f"{redis_prefix}sched:active:{BATCH}") == 0


def test_adding_a_job_twice_indexes_it_once(redis_client: redis.Redis, redis_prefix: str) -> None:
    job = queued("a", INTERACTIVE, 5, 1.0, 48)
    assert queue_index.add(redis_client, redis_prefix, [job]) == 1
    assert queue_index.add(redis_client, redis_prefix, [job]) == 0
    assert redis_client.zcard(queue_index.queue_key(redis_prefix, "m", INTERACTIVE, 5, "a")) == 1


def test_a_user_returning_to_a_class_starts_at_its_virtual_time(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    queue_index.charge(redis_client, redis_prefix, job_id="x", job_class=BATCH, owner="heavy",
                       cost_per_step=10.0, num_inference_steps=1, ttl_seconds=60)
    queue_index.charge(redis_client, redis_prefix, job_id="y", job_class=BATCH, owner="heavy",
                       cost_per_step=10.0, num_inference_steps=1, ttl_seconds=60)
    # The second pick was made at service 10: that is the class's virtual time now.
    queue_index.add(redis_client, redis_prefix, [queued("new", BATCH, 5, 1.0, 48)])
    assert float(redis_client.hget(queue_index.served_key(redis_prefix, BATCH), "new")) == 10.0


def job_row(job_id: str, job_class: str, priority: int, created: float,
            not_before: float | None = None) -> Job:
    """A job row as the API holds it after the commit (no session needed)."""
    return Job(id=job_id, owner_id=1, model="m", class_=job_class, priority=priority, width=64,
               height=64, num_frames=9, num_inference_steps=4,
               created_at=datetime.fromtimestamp(created, UTC),
               not_before=None if not_before is None else datetime.fromtimestamp(not_before, UTC),
               deadline=None)


def _pick(r: redis.Redis, prefix: str, now: float) -> list[str]:
    jobs, _ = queue_index.pick(r, prefix, "m", now=now, aging_seconds=1e6, num_queues=5,
                               num_jobs=5)
    return [j.job_id for j in jobs]


def test_one_add_makes_a_job_seen_by_its_position_the_pick_and_an_idle_group(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    batch, interactive = job_row("b1", BATCH, 9, 1.0), job_row("i1", INTERACTIVE, 0, 2.0)
    assert queue_index.add(redis_client, redis_prefix, [batch, interactive]) == 2
    # Serving order: every interactive job before any batch job, whatever the priority.
    assert queue_index.position(redis_client, redis_prefix, interactive) == 0
    assert queue_index.position(redis_client, redis_prefix, batch) == 1
    assert set(_pick(redis_client, redis_prefix, 10.0)) == {"b1", "i1"}
    assert queue_index.wait_for_work(redis_client, redis_prefix, 0.01)
    assert redis_client.llen(queue_index.wake_key(redis_prefix)) == 0  # one token per add


def test_add_one_answers_the_submitted_jobs_queue_position(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    assert queue_index.add_one(redis_client, redis_prefix, job_row("a", INTERACTIVE, 5, 1.0)) == 0
    assert queue_index.add_one(redis_client, redis_prefix, job_row("b", INTERACTIVE, 5, 2.0)) == 1
    assert queue_index.add_one(redis_client, redis_prefix, job_row("c", INTERACTIVE, 9, 3.0)) == 0
    assert _pick(redis_client, redis_prefix, 10.0)[0] == "c"


def test_a_job_is_due_at_its_not_before_and_never_before_its_creation() -> None:
    assert queue_index.due(job_row("a", BATCH, 5, 100.0)) == 100.0
    assert queue_index.due(job_row("b", BATCH, 5, 100.0, not_before=500.0)) == 500.0
    assert queue_index.due(job_row("c", BATCH, 5, 100.0, not_before=50.0)) == 100.0


def test_a_job_not_yet_due_is_counted_in_the_queue_but_not_picked(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    later = job_row("later", INTERACTIVE, 5, 1.0, not_before=100.0)
    assert queue_index.add_one(redis_client, redis_prefix, later) == 0
    assert _pick(redis_client, redis_prefix, 50.0) == []
    assert _pick(redis_client, redis_prefix, 100.0) == ["later"]


def test_remove_takes_a_job_out_of_every_key(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    kept, gone = job_row("kept", BATCH, 5, 1.0), job_row("gone", BATCH, 5, 2.0)
    queue_index.add(redis_client, redis_prefix, [kept, gone])
    # An entry only its ready key holds goes too.
    redis_client.zadd(queue_index.ready_key(redis_prefix, INTERACTIVE, 9), {"stray": 0.0})
    assert queue_index.remove(redis_client, redis_prefix, ["gone", "stray", "unknown"]) == 2
    assert queue_index.position(redis_client, redis_prefix, gone) is None
    assert queue_index.position(redis_client, redis_prefix, kept) == 0
    assert _pick(redis_client, redis_prefix, 10.0) == ["kept"]
    assert redis_client.hkeys(queue_index.jobs_key(redis_prefix)) == [b"kept"]


def test_every_key_is_served_in_class_order_then_priority_order(redis_prefix: str) -> None:
    keys = queue_index.ready_keys(redis_prefix)
    assert queue_index.CLASSES == (INTERACTIVE, BATCH)
    assert keys == [f"{redis_prefix}ready:{c}:{p}" for c in (INTERACTIVE, BATCH)
                    for p in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1)]


def test_the_scripts_run_on_a_redis_that_has_forgotten_them(
    redis_client: redis.Redis, redis_prefix: str,
) -> None:
    """The first call after Redis restarted (or flushed its scripts) loads the script it needs."""
    job = queued("a", INTERACTIVE, 5, 1.0, 48)
    redis_client.script_flush()
    assert queue_index.add(redis_client, redis_prefix, [job]) == 1
    redis_client.script_flush()
    assert _pick(redis_client, redis_prefix, 10.0) == [job.job_id]
    redis_client.script_flush()
    queue_index.charge(redis_client, redis_prefix, job_id=job.job_id, job_class=INTERACTIVE,
                       owner="a", cost_per_step=0.5, num_inference_steps=4, ttl_seconds=60)
    assert float(redis_client.hget(queue_index.served_key(redis_prefix, INTERACTIVE), "a")) == 2.0
