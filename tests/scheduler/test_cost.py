"""The cost model learns per layout: a step split over sp ranks is not the step of one rank."""

from __future__ import annotations

from datetime import timedelta

import redis
from sqlalchemy.orm import Session
from test_claim import T0, claim, submit, user

from scheduler import claim as sched
from scheduler import queue_index
from scheduler.cost import CostModel, cost_key_for
from scheduler.records import ChargeRecord


def test_the_cost_key_is_the_model_at_sp1_and_names_the_layout_otherwise() -> None:
    assert cost_key_for("kiln-tiny") == cost_key_for("kiln-tiny", 1) == "kiln-tiny"
    assert cost_key_for("kiln-tiny", 2) == "kiln-tiny@sp2"


def test_costs_learned_at_sp2_leave_the_sp1_estimate_as_it_was() -> None:
    alone = CostModel()
    for num_tokens in (48, 96, 192):
        alone.observe("kiln-tiny", num_tokens, 0.01 + 1e-4 * num_tokens)
    before = alone.step_seconds("kiln-tiny", 96)
    state = alone.to_state()

    split = CostModel.from_state(state, sp=2)
    assert split.step_seconds("kiln-tiny", 96) != before  # no sp=2 history yet: the default
    for num_tokens in (48, 96, 192):
        split.observe("kiln-tiny", num_tokens, 0.5 + 1e-2 * num_tokens)
    assert abs(split.step_seconds("kiln-tiny", 96) - (0.5 + 1e-2 * 96)) < 1e-9

    both = split.to_state()
    assert set(both) == {"kiln-tiny", "kiln-tiny@sp2"}
    assert CostModel.from_state(both).step_seconds("kiln-tiny", 96) == before
    assert CostModel.from_state(both, sp=2).step_seconds("kiln-tiny", 96) == \
        split.step_seconds("kiln-tiny", 96)


def test_a_result_recorded_at_sp2_teaches_only_the_sp2_claims(
    session: Session, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    sched.record_result(redis_client, prefix=redis_prefix, job_id="j1", model="kiln-tiny",
                        num_tokens=48, num_inference_steps=4, render_seconds=2.0)
    sched.record_result(redis_client, prefix=redis_prefix, job_id="j2", model="kiln-tiny",
                        num_tokens=48, num_inference_steps=4, render_seconds=8.0, sp=2)
    assert abs(sched.load_costs(redis_client, redis_prefix).step_seconds("kiln-tiny", 48)
               - 0.5) < 1e-9
    assert abs(sched.load_costs(redis_client, redis_prefix, sp=2).step_seconds("kiln-tiny", 48)
               - 2.0) < 1e-9

    # A group of sp=2 replicas charges what a step costs it; a group of single ranks, its own.
    alice = user(session, "alice")
    first = submit(session, redis_client, redis_prefix, alice)
    second = submit(session, redis_client, redis_prefix, alice)
    [(_, c)] = sched.claim_for_group(session, redis_client, prefix=redis_prefix, group_id="g2",
                                     model="kiln-tiny", free_ranks=[0], lease_seconds=60,
                                     now=T0 + timedelta(seconds=1), sp=2)
    [(_, d)] = claim(session, redis_client, redis_prefix, [0])
    assert {c.job.id, d.job.id} == {first.id, second.id}
    charged = {job_id: ChargeRecord.decode(redis_client.get(
                   queue_index.charge_key(redis_prefix, job_id))).cost_per_step
               for job_id in (c.job.id, d.job.id)}
    assert abs(charged[c.job.id] - 2.0) < 1e-9
    assert abs(charged[d.job.id] - 0.5) < 1e-9
