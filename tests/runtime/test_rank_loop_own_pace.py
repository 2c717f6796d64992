"""Replicas at their own pace (`runtime.rank_loop.run_loop(own_pace=True)`): where no weights are
gathered across ranks, a replica's steps, admission, cancel and finish never wait for another
replica's step; where they are (allgather), the group keeps its lock-step turns.

Two CPU ranks over gloo, kiln-tiny, a script for rank 0's driver. The big job's step takes
~0.2 s on one torch thread, the small job's ~15 ms: at its own pace the small job (4 steps) ends
before the big one has run two steps; in lock-step every one of its steps is a turn of the big
job, so it cannot end before the big job's fourth step.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from multirank import run_ranks

from common.families import TINY_MODEL
from runtime.mailbox import Mailbox
from runtime.pipelines.base import VideoRequest
from runtime.platform import get_platform
from runtime.rank_loop import (
    Ended,
    Progress,
    RankLoop,
    RankMessage,
    RankReport,
    StepPlan,
    Ticket,
    _Conductor,
    run_loop,
)
from runtime.render import load_pipeline
from runtime.sequence import Layout, open_sequence

BIG = VideoRequest(prompt="a red circle moving left", width=256, height=256, num_frames=17,
                   num_inference_steps=8, seed=1)
SMALL = VideoRequest(prompt="a blue square", width=64, height=64, num_frames=9,
                     num_inference_steps=4, seed=2)
LONG = VideoRequest(prompt="a green dot", width=64, height=64, num_frames=9,
                    num_inference_steps=200, seed=3)


class Script:
    """Big on replica 0 and small on replica 1 at once; once small has ended, a long job on
    replica 1, cancelled at its step 5. At their own pace, once big has run 2 steps, replica 0
    is held and, once it says it waits, given job "i" (small's request), which runs before big
    goes on. Stops when big has ended."""

    def __init__(self) -> None:
        self.own_pace: bool | None = None
        self.steps: dict[str, list[int]] = {}  # job id -> the steps its Progress reported
        self.ended: dict[str, Ended] = {}
        self.big_step_at_small_end: int | None = None
        self.began = self.sent_long = self.dropped_long = False
        self.held = self.sent_i = False
        self.big_step_when_waiting: int | None = None
        self.big_step_at_i_end: int | None = None

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        self.own_pace = own_pace

    def next_plan(self, stop_requested: bool) -> StepPlan:
        plan = StepPlan(step=True)
        if not self.began:
            self.began = True
            plan.assign = {0: Ticket(job_id="big", attempt_token="t", request=BIG),
                           1: Ticket(job_id="small", attempt_token="t", request=SMALL)}
        elif "small" in self.ended and not self.sent_long:
            self.sent_long = True
            plan.assign = {1: Ticket(job_id="long", attempt_token="t", request=LONG)}
        elif self.steps.get("long", [0])[-1] >= 5 and not self.dropped_long:
            self.dropped_long = True
            plan.drop = {"long": "cancelled by the test"}
        elif "big" in self.ended and "long" in self.ended:
            plan = StepPlan(stop=True)
        if self.own_pace and not self.held and self.steps.get("big", [0])[-1] >= 2:
            self.held = True
            plan.hold = [0]
        elif self.big_step_when_waiting is not None and not self.sent_i:
            self.sent_i = True
            plan.assign[0] = Ticket(job_id="i", attempt_token="t", request=SMALL)
        return plan

    def record(self, messages: list[RankMessage]) -> None:
        for m in messages:
            if isinstance(m, Progress) and m.computed:
                self.steps.setdefault(m.job_id, []).append(m.step)
            elif isinstance(m, Ended):
                self.ended[m.job_id] = m
                if m.job_id == "small":
                    self.big_step_at_small_end = self.steps.get("big", [0])[-1]
                if m.job_id == "i":
                    self.big_step_at_i_end = self.steps["big"][-1]
            elif isinstance(m, RankReport) and m.waiting and self.big_step_when_waiting is None:
                self.big_step_when_waiting = self.steps["big"][-1]

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _run_replicas(rank: int, world: int, driver: Any, use_allgather: bool = False) -> None:
    """This rank's part of two replicas of one rank each, kiln-tiny, at their own pace (in
    lock-step where they gather weights), ``driver`` on rank 0, until it stops them."""
    layout = Layout(dp=2, sp=1)
    platform = get_platform("cpu")
    pipe = load_pipeline(TINY_MODEL, device=platform.device, use_allgather=use_allgather,
                         sequence=open_sequence(layout, platform.backend))
    loop = RankLoop(rank, pipe, lambda frames, job_id, fps: ("v", "t"), platform, layout=layout)
    run_loop(rank, world, loop, driver, own_pace=True)


def _rank(rank: int, world: int, use_allgather: bool) -> dict[str, Any] | None:
    script = Script() if rank == 0 else None
    _run_replicas(rank, world, script, use_allgather)
    if script is None:
        return None
    return {"own_pace": script.own_pace, "steps": script.steps,
            "ended": {j: (m.outcome, m.step) for j, m in script.ended.items()},
            "big_step_at_small_end": script.big_step_at_small_end,
            "big_step_when_waiting": script.big_step_when_waiting,
            "big_step_at_i_end": script.big_step_at_i_end}


@pytest.mark.parametrize("use_allgather", [False, True], ids=["rank-local", "allgather"])
def test_a_small_job_beside_a_big_one_keeps_its_own_pace_unless_the_weights_are_gathered(
        use_allgather: bool) -> None:
    out = run_ranks(2, _rank, use_allgather, timeout=180)[0]
    assert out["own_pace"] is (not use_allgather)
    assert out["ended"]["small"] == ("succeeded", 4)
    assert out["ended"]["big"] == ("succeeded", 8)
    # Every step of every job is reported once, in order (the last one ends the job instead).
    assert out["steps"]["small"] == [1, 2, 3]
    assert out["steps"]["big"] == list(range(1, 8))
    # The long job on replica 1 was cancelled at a step boundary, replica 0 unaffected.
    outcome, step = out["ended"]["long"]
    assert outcome == "cancelled" and 5 <= step < 200
    if use_allgather:
        assert out["big_step_at_small_end"] >= 4  # one turn of the big job per small step
        assert "i" not in out["ended"]  # no hold in lock-step
    else:
        assert out["big_step_at_small_end"] <= 2, out
        # Held (part-way through a step, which it took again later), replica 0 stepped no more
        # until "i" came, then ran "i" whole before big's next step.
        assert out["ended"]["i"] == ("succeeded", 4)
        assert out["big_step_when_waiting"] == out["big_step_at_i_end"] >= 2, out


class PauseScript:
    """Big on replica 0, long on replica 1. Once long has run 2 steps, replica 0 is paused
    (`StepPlan.pause`: what a coordinator on a CPU host sends while interactive work runs
    beside a batch job); once long has run 10 more, big is named to run again; long is dropped
    once big has ended. Notes big's steps when replica 0 first said it waits and when it ran
    again."""

    def __init__(self) -> None:
        self.steps: dict[str, list[int]] = {}
        self.ended: dict[str, Ended] = {}
        self.began = self.paused = self.resumed = self.dropped = False
        self.long_at_pause = 0
        self.big_when_waiting: int | None = None
        self.big_at_resume: int | None = None

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def _step(self, job_id: str) -> int:
        return self.steps.get(job_id, [0])[-1]

    def next_plan(self, stop_requested: bool) -> StepPlan:
        plan = StepPlan(step=True)
        if not self.began:
            self.began = True
            plan.assign = {0: Ticket(job_id="big", attempt_token="t", request=BIG),
                           1: Ticket(job_id="long", attempt_token="t", request=LONG)}
        elif not self.paused and self._step("long") >= 2:
            self.paused, self.long_at_pause = True, self._step("long")
            plan.pause = [0]
        elif (self.paused and not self.resumed and self.big_when_waiting is not None
              and self._step("long") >= self.long_at_pause + 10):
            self.resumed, self.big_at_resume = True, self._step("big")
            plan.run = {0: "big"}
        elif "big" in self.ended and not self.dropped:
            self.dropped = True
            plan.drop = {"long": "cancelled by the test"}
        elif "long" in self.ended:
            plan = StepPlan(stop=True)
        return plan

    def record(self, messages: list[RankMessage]) -> None:
        for m in messages:
            if isinstance(m, Progress) and m.computed:
                self.steps.setdefault(m.job_id, []).append(m.step)
            elif isinstance(m, Ended):
                self.ended[m.job_id] = m
            elif (isinstance(m, RankReport) and m.rank == 0 and m.waiting and self.paused
                  and self.big_when_waiting is None):
                self.big_when_waiting = self._step("big")

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _pause_rank(rank: int, world: int) -> dict[str, Any] | None:
    script = PauseScript() if rank == 0 else None
    _run_replicas(rank, world, script)
    if script is None:
        return None
    return {"ended": {j: (m.outcome, m.step) for j, m in script.ended.items()},
            "big_when_waiting": script.big_when_waiting, "big_at_resume": script.big_at_resume}


def test_a_paused_replica_sits_out_until_it_is_named_to_run_again() -> None:
    """Paused part-way through a step, replica 0 steps no more while replica 1 runs 10 steps,
    and reports that it waits; named to run again, it takes its step again and finishes its job
    (that a step so left gives its blocks back: tests/runtime/test_step_interrupt.py)."""
    out = run_ranks(2, _pause_rank, timeout=180)[0]
    assert out["ended"]["big"] == ("succeeded", 8)
    assert out["big_when_waiting"] is not None
    assert out["big_at_resume"] == out["big_when_waiting"] < 8, out


def _sp_rank(rank: int, world: int) -> list[Any] | None:
    """One replica of two ranks (rank-local): its first rank takes the orders and hands them to
    the other on the replica's own group."""
    layout = Layout(dp=1, sp=2)
    platform = get_platform("cpu")
    pipe = load_pipeline(TINY_MODEL, device=platform.device, use_allgather=False,
                         sequence=open_sequence(layout, platform.backend))
    loop = RankLoop(rank, pipe, lambda frames, job_id, fps: ("v", "t"), platform, layout=layout)

    class Two:
        own_pace = None
        ended: list[tuple[str, str, int]] = []
        sent = 0

        def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
            self.own_pace = own_pace

        def next_plan(self, stop_requested: bool) -> StepPlan:
            if len(self.ended) == 2:
                return StepPlan(stop=True)
            if self.sent == len(self.ended) and self.sent < 2:
                self.sent += 1
                return StepPlan(step=True, assign={0: Ticket(
                    job_id=f"j{self.sent}", attempt_token="t", request=SMALL)})
            return StepPlan(step=True)

        def record(self, messages: list[RankMessage]) -> None:
            self.ended += [(m.job_id, m.outcome, m.step) for m in messages
                           if isinstance(m, Ended)]

        def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
            pass

    driver = Two() if rank == 0 else None
    run_loop(rank, world, loop, driver, own_pace=True)
    return [driver.own_pace, driver.ended] if driver is not None else None


def test_a_replica_of_two_ranks_at_its_own_pace_keeps_its_ranks_in_step() -> None:
    own_pace, ended = run_ranks(2, _sp_rank, timeout=180)[0]
    assert own_pace is True
    assert ended == [("j1", "succeeded", 4), ("j2", "succeeded", 4)]


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    yield dist.PrefixStore("test/", server)


def test_the_mailbox_keeps_each_queue_in_order_and_waits_only_as_long_as_asked(
        store: Any) -> None:
    box = Mailbox(store)
    box.send(1, ["a"])
    box.send(1, ["b", "c"])
    assert box.orders(1) == ["a", "b", "c"]
    assert box.orders(0) == []
    started = time.monotonic()
    assert box.orders(1, wait=0.1) == []
    assert 0.1 <= time.monotonic() - started < 1.0
    other = box.clone()  # a second thread's own connection to the same queues
    other.report([RankReport(rank=1)])
    box.report([RankReport(rank=0)])
    assert [m.rank for m in box.reports(wait=1.0)] == [1, 0]


class Idle:
    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def next_plan(self, stop_requested: bool) -> StepPlan:
        return StepPlan()

    def record(self, messages: list[RankMessage]) -> None:
        pass

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def test_a_rank_that_stops_reporting_fails_the_coordinator(store: Any) -> None:
    box = Mailbox(store)
    conductor = _Conductor(Idle(), box.clone(), Layout(dp=2, sp=1), None, peer_timeout_s=0.3)
    conductor.start()
    deadline = time.monotonic() + 5
    while conductor.error is None and time.monotonic() < deadline:
        box.report([RankReport(rank=0)])  # rank 0 reports, rank 1 never does
        time.sleep(0.05)
    conductor.close()
    assert isinstance(conductor.error, RuntimeError)
    assert "rank 1 has not reported" in str(conductor.error)
