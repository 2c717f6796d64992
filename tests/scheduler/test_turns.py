"""The turn choice of a worker group (`scheduler.turns`): who computes, who sits out, and
where an interactive job preempts batch work; pure, no server, no process."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.turns import HeldJob, TurnConfig, choose_turn, preempt_target


def job(job_id: str, replica: int, job_class: str = "batch", *, step: float = 1.0,
        steps_left: int = 10, order: int = 0, paused: float = 0.0) -> HeldJob:
    return HeldJob(job_id=job_id, replica=replica, job_class=job_class,
                   seconds_per_step=step, steps_left=steps_left, order=order,
                   paused_seconds=paused)


def test_batch_work_alone_computes_on_every_replica() -> None:
    turn = choose_turn([job("a", 0, step=14.0), job("b", 1, step=0.1)])
    assert turn.run == {0: "a", 1: "b"} and turn.pause == set()


def test_a_dear_batch_job_sits_out_while_a_cheap_interactive_job_runs_beside_it() -> None:
    turn = choose_turn([job("big", 0, step=14.0), job("small", 1, "interactive", step=0.04)])
    assert turn.run == {1: "small"}
    assert turn.pause == {0}
    assert "paused" in turn.waiting["big"]


def test_replicas_at_their_own_pace_all_compute_and_each_runs_its_interactive_job_first(
        ) -> None:
    held = [job("big", 0, step=14.0), job("small", 1, "interactive", step=0.04),
            job("batch", 1, step=0.5, order=-1)]
    turn = choose_turn(held, shared=False)
    assert turn.run == {0: "big", 1: "small"} and turn.pause == set()
    assert "suspended" in turn.waiting["batch"] and "big" not in turn.waiting


def test_a_batch_job_about_as_cheap_as_the_interactive_one_computes_with_it() -> None:
    turn = choose_turn([job("b", 0, step=0.045), job("i", 1, "interactive", step=0.04)],
                       TurnConfig(slack=0.25))
    assert turn.run == {0: "b", 1: "i"}


def test_a_batch_job_paused_for_max_pause_seconds_computes_whatever_runs_beside_it() -> None:
    turn = choose_turn([job("big", 0, step=14.0, paused=30.0),
                        job("small", 1, "interactive", step=0.04)],
                       TurnConfig(max_pause_seconds=30.0))
    assert turn.run == {0: "big", 1: "small"}


def test_on_one_replica_the_interactive_job_runs_and_the_batch_job_is_suspended() -> None:
    turn = choose_turn([job("batch", 0, step=1.0, order=1),
                        job("inter", 0, "interactive", step=1.0, order=2)])
    assert turn.run == {0: "inter"}
    assert turn.waiting == {"batch": "suspended for job inter"}


def test_a_suspended_job_that_waited_too_long_runs_before_the_interactive_one() -> None:
    turn = choose_turn([job("batch", 0, paused=31.0, order=1),
                        job("inter", 0, "interactive", order=2)],
                       TurnConfig(max_pause_seconds=30.0))
    assert turn.run == {0: "batch"}


def test_preemption_targets_the_replica_whose_batch_job_has_most_work_left() -> None:
    held = [job("a", 0, step=1.0, steps_left=5), job("b", 1, step=2.0, steps_left=30)]
    assert preempt_target(held, [0, 1], max_jobs_per_replica=2) == 1


def test_no_preemption_of_a_replica_that_is_full_holds_interactive_work_or_starved_batch() -> None:
    full = [job("a", 0), job("b", 0, order=1)]
    assert preempt_target(full, [0], max_jobs_per_replica=2) is None
    assert preempt_target([job("i", 0, "interactive")], [0], max_jobs_per_replica=2) is None
    starved = [job("a", 0, paused=40.0)]
    assert preempt_target(starved, [0], max_jobs_per_replica=2,
                          config=TurnConfig(max_pause_seconds=30.0)) is None
    assert preempt_target([], [0, 1], max_jobs_per_replica=2) is None  # free replicas: no need


jobs = st.lists(st.builds(
    HeldJob, job_id=st.uuids().map(str), replica=st.integers(0, 3),
    job_class=st.sampled_from(["interactive", "batch"]),
    seconds_per_step=st.floats(0.001, 100.0), steps_left=st.integers(0, 100),
    order=st.integers(0, 1000), paused_seconds=st.floats(0.0, 100.0)), max_size=8)


@given(jobs)
def test_every_replica_holding_jobs_runs_one_or_sits_out_and_someone_always_computes(
        held: list[HeldJob]) -> None:
    turn = choose_turn(held)
    replicas = {j.replica for j in held}
    assert set(turn.run) | turn.pause == replicas
    assert not set(turn.run) & turn.pause
    assert (not held) or turn.run
    ids = {j.job_id: j for j in held}
    for replica, job_id in turn.run.items():
        assert ids[job_id].replica == replica
    # Every interactive job chosen on its replica computes; nothing waits without a reason.
    assert set(turn.run.values()) | set(turn.waiting) == set(ids)


def test_a_job_not_yet_measured_is_costed_by_how_far_off_the_estimates_were() -> None:
    # The cost model guessed 0.37 "seconds" for the small job and 1.6 for the big one; the big
    # one measured 0.035 s a step, so the small one is taken for ~0.008 s: the big one pauses.
    big = job("big", 0, step=1.6, steps_left=10)
    big.measured = 0.035
    small = job("small", 1, "interactive", step=0.37, steps_left=4)
    turn = choose_turn([big, small])
    assert turn.run == {1: "small"} and turn.pause == {0}
