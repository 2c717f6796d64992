"""The pure policy, without Redis or a database: properties (hypothesis) and worked examples."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost import CostModel
from scheduler.policy import (
    BATCH,
    CLASS_BASE,
    DEFAULT_GOAL,
    INTERACTIVE,
    TOP_LEVEL,
    JobResult,
    Policy,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    class_bases,
    level,
)

PROPS = settings(max_examples=40, deadline=None)
_ids = itertools.count()


def job(*, owner: str = "alice", model: str = "m", job_class: str = INTERACTIVE,
        priority: int = 5, due: float = 0.0, deadline: float | None = None,
        num_tokens: int = 100, num_inference_steps: int = 4) -> QueuedJob:
    return QueuedJob(job_id=f"j{next(_ids)}", owner=owner, model=model, job_class=job_class,
                     priority=priority, due=due, deadline=deadline, num_tokens=num_tokens,
                     num_inference_steps=num_inference_steps)


job_st = st.builds(
    lambda owner, model, cls, prio, due, dl, tok, steps: job(
        owner=owner, model=model, job_class=cls, priority=prio, due=due,
        deadline=None if dl is None else due + dl, num_tokens=tok, num_inference_steps=steps),
    st.sampled_from(["alice", "bob", "carol"]), st.sampled_from(["m", "n"]),
    st.sampled_from([INTERACTIVE, BATCH]), st.integers(0, 9), st.integers(0, 50).map(float),
    st.one_of(st.none(), st.integers(1, 60).map(float)), st.sampled_from([48, 192, 768]),
    st.sampled_from([4, 8, 16]),
)


# -- properties ---------------------------------------------------------------------------------

@PROPS
@given(jobs=st.lists(job_st, max_size=40), ticks=st.lists(
    st.tuples(st.sampled_from(["m", "n"]), st.integers(1, 4), st.integers(0, 3)), max_size=30))
def test_no_job_is_assigned_twice_and_only_queued_jobs_are_assigned(
    jobs: list[QueuedJob], ticks: list[tuple[str, int, int]],
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=20.0))
    policy.add_many(jobs)
    known = {j.job_id for j in jobs}
    assigned: list[str] = []
    expired: list[str] = []
    removed: set[str] = set()
    now = 0.0
    for model, num_free, num_removed in ticks:
        now += 5.0
        # Some jobs leave by other ways (cancelled, claimed by another group).
        for j in jobs[:num_removed]:
            if policy.remove(j.job_id) is not None:
                removed.add(j.job_id)
        plan = policy.schedule(range(num_free), model=model, now=now)
        assert len(plan.assignments) <= num_free
        assigned += plan.assignments.values()
        expired += plan.expired
    assert len(assigned) == len(set(assigned))
    assert set(assigned) <= known - removed
    assert not set(assigned) & set(expired)
    assert len(expired) == len(set(expired))


@PROPS
@given(jobs=st.lists(job_st, min_size=1, max_size=40), aging=st.sampled_from([10.0, 30.0, 1e9]),
       step=st.sampled_from([1.0, 7.0]), prefer=st.sampled_from([INTERACTIVE, BATCH]))
def test_every_pick_is_of_the_highest_level_among_due_jobs_of_the_model(
    jobs: list[QueuedJob], aging: float, step: float, prefer: str,
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=aging))
    policy.add_many(jobs)
    waiting = {j.job_id: j for j in jobs}
    bases = class_bases(prefer)
    now = 0.0
    for _ in range(60):
        now += step
        for model in ("m", "n"):
            plan = policy.schedule([0], model=model, now=now, prefer=prefer)
            for job_id in plan.expired:
                del waiting[job_id]
            if not plan.assignments:
                continue
            picked = waiting.pop(plan.assignments[0])
            assert picked.due <= now and (picked.deadline is None or picked.deadline > now)
            mine = level(picked.job_class, picked.priority, picked.due, now, aging, bases)
            rivals = [level(j.job_class, j.priority, j.due, now, aging, bases)
                      for j in waiting.values() if j.model == model and j.due <= now
                      and (j.deadline is None or j.deadline > now)]
            assert all(r <= mine for r in rivals)
            if aging > 1e8:  # no aging: the preferred class strictly before the other
                assert picked.job_class == prefer or all(
                    j.job_class != prefer for j in waiting.values()
                    if j.model == model and j.due <= now
                    and (j.deadline is None or j.deadline > now))


@PROPS
@given(job_class=st.sampled_from([INTERACTIVE, BATCH]), priority=st.integers(0, 9),
       aging=st.sampled_from([5.0, 20.0]), dp=st.integers(1, 4), flood=st.integers(0, 3),
       owners=st.integers(1, 3), prefer=st.sampled_from([INTERACTIVE, BATCH]))
def test_a_job_starts_within_the_aging_bound_under_a_flood_of_fresh_top_priority_work(
    job_class: str, priority: int, aging: float, dp: int, flood: int, owners: int, prefer: str,
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=aging))
    victim = job(owner="victim", job_class=job_class, priority=priority, due=0.0)
    policy.add(victim)
    # Its user has had far more than a fair share, so fairness alone would never pick it.
    policy.set_served(job_class, "victim", 1e9)
    tick = 1.0
    bound = (TOP_LEVEL - class_bases(prefer)[job_class] - priority) * aging + tick
    now, started = 0.0, None
    while started is None and now <= bound + 10 * tick:
        # More fresh priority-9 work of the class the group prefers arrives every tick than
        # the ranks can take.
        for i in range(dp + flood):
            policy.add(job(owner=f"u{i % owners}", job_class=prefer, priority=9, due=now))
        # every job lasts one tick
        plan = policy.schedule(range(dp), model="m", now=now, prefer=prefer)
        if victim.job_id in plan.assignments.values():
            started = now
        now += tick
    assert started is not None and started <= bound


@PROPS
@given(jobs=st.lists(job_st, max_size=40), num_free=st.integers(1, 3))
def test_deadlines_no_job_starts_at_or_after_its_deadline_and_each_late_one_expires_once(
    jobs: list[QueuedJob], num_free: int,
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=15.0))
    policy.add_many(jobs)
    by_id = {j.job_id: j for j in jobs}
    started: dict[str, float] = {}
    expired: dict[str, float] = {}
    now = 0.0
    while now < 150.0:
        for model in ("m", "n"):
            plan = policy.schedule(range(num_free), model=model, now=now)
            for job_id in plan.assignments.values():
                started[job_id] = now
            for job_id in plan.expired:
                assert job_id not in expired
                expired[job_id] = now
        now += 3.0
    for job_id, t in started.items():
        deadline = by_id[job_id].deadline
        assert deadline is None or t < deadline
    for job_id, t in expired.items():
        deadline = by_id[job_id].deadline
        assert deadline is not None and deadline <= t < deadline + 3.0
    # Every job with a deadline within the run either started in time or expired.
    for j in jobs:
        if j.deadline is not None and j.deadline < 145.0:
            assert (j.job_id in started) != (j.job_id in expired)


@PROPS
@given(counts=st.lists(st.integers(1, 60), min_size=2, max_size=4),
       tokens=st.lists(st.sampled_from([48, 192, 768]), min_size=1, max_size=4),
       job_class=st.sampled_from([INTERACTIVE, BATCH]), dp=st.integers(1, 3),
       prefer=st.sampled_from([INTERACTIVE, BATCH]))
def test_backlogged_users_of_a_class_stay_within_one_job_of_equal_service(
    counts: list[int], tokens: list[int], job_class: str, dp: int, prefer: str,
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=1e9))
    owners = [f"u{i}" for i in range(len(counts))]
    left = dict(zip(owners, counts, strict=True))
    for owner, count in left.items():
        for i in range(count):
            policy.add(job(owner=owner, job_class=job_class, priority=3,
                           num_tokens=tokens[i % len(tokens)], due=0.0))
    costs = CostModel()
    biggest = max(costs.step_seconds("m", t) for t in tokens) * 4
    now = 1.0
    while True:
        plan = policy.schedule(range(dp), model="m", now=now, prefer=prefer)
        if not plan.assignments:
            break
        backlogged = [o for o in owners if policy_has(policy, o)]
        served = [policy.served(job_class, o) for o in backlogged]
        if len(served) >= 2:
            # Service is charged at the start; a pick goes to the least served, so waiting
            # users never trail the others by more than one job.
            assert max(served) - min(served) <= biggest + 1e-9
        now += 1.0
    assert len(policy) == 0


def policy_has(policy: Policy, owner: str) -> bool:
    return any(j.owner == owner for j in policy._jobs.values())


# -- worked examples ----------------------------------------------------------------------------

def test_interactive_goes_before_batch_and_higher_priority_before_lower() -> None:
    policy = Policy()
    batch = job(job_class=BATCH, priority=9)
    low = job(priority=1)
    high = job(priority=8)
    policy.add_many([batch, low, high])
    plan = policy.schedule([0, 1, 2], model="m", now=1.0)
    assert plan.assignments == {0: high.job_id, 1: low.job_id, 2: batch.job_id}


def test_class_bases_put_the_preferred_class_on_top_and_goals_default_by_layout() -> None:
    assert class_bases() == class_bases(INTERACTIVE) == CLASS_BASE
    assert class_bases(BATCH) == {BATCH: 10, INTERACTIVE: 0}
    with pytest.raises(ValueError, match="prefer"):
        class_bases("overnight")
    assert DEFAULT_GOAL == "latency"  # interactive first unless a pool says otherwise


def test_a_group_that_prefers_batch_takes_batch_first_then_interactive() -> None:
    policy = Policy()
    urgent = job(priority=9)
    night = job(job_class=BATCH, priority=0)
    policy.add_many([urgent, night])
    # Fresh work of the preferred class goes first, whatever the other class's priority.
    assert policy.schedule([0], model="m", now=1.0, prefer=BATCH).assignments == {
        0: night.job_id}
    # With no batch job due, the interactive one is taken: no rank idles while work waits.
    assert policy.schedule([0], model="m", now=1.0, prefer=BATCH).assignments == {
        0: urgent.job_id}


def test_a_group_that_prefers_interactive_takes_batch_when_no_interactive_job_is_due() -> None:
    policy = Policy()
    night = job(job_class=BATCH, priority=0)
    later = job(priority=9, due=50.0)  # not due yet: it does not hold the batch job back
    policy.add_many([night, later])
    assert policy.schedule([0], model="m", now=1.0).assignments == {0: night.job_id}
    assert policy.schedule([0], model="m", now=50.0).assignments == {0: later.job_id}


def test_aging_lifts_an_old_interactive_job_above_fresh_batch_work_for_a_throughput_group(
) -> None:
    policy = Policy(PolicyConfig(aging_seconds=10.0))
    old = job(priority=0, due=0.0)  # level 0 for a throughput group, 20 after 200 s
    policy.add(old)
    policy.add(job(job_class=BATCH, priority=9, due=200.0))
    assert policy.schedule([0], model="m", now=200.0, prefer=BATCH).assignments == {
        0: old.job_id}


def test_a_job_waits_for_its_not_before() -> None:
    policy = Policy()
    later = job(due=100.0)
    policy.add(later)
    assert policy.schedule([0], model="m", now=99.0).assignments == {}
    assert policy.schedule([0], model="m", now=100.0).assignments == {0: later.job_id}


def test_jobs_of_other_models_are_never_assigned_to_a_group() -> None:
    policy = Policy()
    other = job(model="n", priority=9)
    mine = job(model="m", priority=0)
    policy.add_many([other, mine])
    assert policy.schedule([0, 1], model="m", now=1.0).assignments == {0: mine.job_id}


def test_aging_lifts_an_old_batch_job_above_fresh_interactive_work() -> None:
    policy = Policy(PolicyConfig(aging_seconds=10.0))
    old = job(job_class=BATCH, priority=0, due=0.0)
    policy.add(old)
    # Level 0 + 200 s / 10 s = 20 = the top, above any fresh job (at most 19).
    fresh = job(priority=9, due=200.0)
    policy.add(fresh)
    assert policy.schedule([0], model="m", now=200.0).assignments == {0: old.job_id}


def test_one_users_ten_thousand_jobs_alternate_with_another_users_ten() -> None:
    policy = Policy()
    for _ in range(10_000):
        policy.add(job(owner="alice", job_class=BATCH, due=0.0))
    bobs = [job(owner="bob", job_class=BATCH, due=1.0) for _ in range(10)]
    policy.add_many(bobs)
    order: list[str] = []
    for t in range(10):
        order += policy.schedule([0, 1], model="m", now=2.0 + t).assignments.values()
    # The first 20 starts: Bob's 10 and 10 of Alice's, one of each per call.
    assert {j.job_id for j in bobs} <= set(order[:20])


def test_a_returning_user_starts_at_the_class_virtual_time_not_at_zero() -> None:
    policy = Policy()
    for _ in range(6):
        policy.add(job(owner="alice", job_class=BATCH))
    policy.schedule([0, 1, 2], model="m", now=1.0)
    newcomer = job(owner="bob", job_class=BATCH, due=1.0)
    policy.add(newcomer)
    # Bob enters level with the service of the latest pick, not with a 3-job head start.
    assert policy.served(BATCH, "bob") == pytest.approx(2 * policy.costs.step_seconds("m", 100) * 4)
    plan = policy.schedule([0, 1], model="m", now=2.0)
    assert newcomer.job_id in plan.assignments.values()


def test_grouping_prefers_a_job_whose_step_cost_matches_what_the_group_runs() -> None:
    policy = Policy(PolicyConfig(cost_window=4))
    small = job(num_tokens=48, due=0.0)
    big = job(num_tokens=768, due=1.0)
    policy.add_many([small, big])
    running = [RunningJob(job_id="r", rank=0, model="m",
                          cost_per_step=policy.costs.step_seconds("m", 768), steps_left=10)]
    plan = policy.schedule([1], model="m", running=running, now=2.0)
    assert plan.assignments == {1: big.job_id}
    # With nothing running the oldest goes first.
    assert policy.schedule([0], model="m", now=2.0).assignments == {0: small.job_id}


def test_grouping_never_overrides_priority() -> None:
    policy = Policy(PolicyConfig(cost_window=4))
    small_high = job(num_tokens=48, priority=9)
    big_low = job(num_tokens=768, priority=1)
    policy.add_many([small_high, big_low])
    running = [RunningJob(job_id="r", rank=0, model="m",
                          cost_per_step=policy.costs.step_seconds("m", 768), steps_left=10)]
    assert policy.schedule([1], model="m", running=running,
                           now=1.0).assignments == {1: small_high.job_id}


def test_results_teach_the_cost_model_and_replace_the_estimated_charge() -> None:
    policy = Policy()
    a = job(num_tokens=100, num_inference_steps=4)
    policy.add(a)
    policy.schedule([0], model="m", now=1.0)
    policy.update_from_output([JobResult(job_id=a.job_id, model="m", num_tokens=100,
                                         num_inference_steps=4, render_seconds=8.0)])
    assert policy.served(INTERACTIVE, "alice") == pytest.approx(8.0)
    assert policy.costs.step_seconds("m", 100) == pytest.approx(2.0)


def test_bad_input_is_a_value_error() -> None:
    policy = Policy()
    with pytest.raises(ValueError, match="priority"):
        policy.add(job(priority=10))
    with pytest.raises(ValueError, match="job_class"):
        policy.add(job(job_class="urgent"))
    with pytest.raises(ValueError, match="both free and running"):
        policy.schedule([0], model="m", now=0.0, running=[
            RunningJob(job_id="x", rank=0, model="m", cost_per_step=1.0, steps_left=2)])
    with pytest.raises(ValueError, match="aging_seconds"):
        PolicyConfig(aging_seconds=math.inf)
