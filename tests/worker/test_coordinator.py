"""The worker group coordinator's decisions, with no server and no process.

`kiln.coordinator.Coordinator` is driven turn by turn as the rank loop drives it (``next_plan``,
then ``record`` with the ranks' statuses), with `MemoryIO` in place of the servers (a queue, the
attempts, the job events, all in memory) and a clock the test moves. Each test is one decision:
what is claimed and for which replica, who computes, what is cancelled, handed back, retried,
and what an outage changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kiln.config import WorkerConfig
from kiln.coordinator import HANDED_BACK, LEASE_LOST, Coordinator
from kiln.group_io import Attempt, Claimed
from runtime.pipelines.base import VideoRequest
from runtime.rank_loop import Ended, Progress, RankMessage, RankReport, Rendered, StepPlan, Ticket
from runtime.sequence import Layout
from scheduler.attempts import Ending
from scheduler.cost import CostModel
from scheduler.policy import RunningJob
from storage.lifecycle import Beat
from storage.workers import GroupReport

BATCH, INTERACTIVE = "batch", "interactive"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Queued:
    job_id: str
    job_class: str
    steps: int
    tokens: int
    step_cache: float | None = None


@dataclass
class MemoryIO:
    """`kiln.group_io.GroupIO` in memory: ``down`` makes every call fail as Redis does when
    it is out."""

    clock: Clock
    queue: list[Queued] = field(default_factory=list)
    running: dict[str, str] = field(default_factory=dict)  # job id -> attempt token
    cancelled: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)  # job ids whose lease the reaper took
    ended: list[tuple[str, str, Ending]] = field(default_factory=list)
    notes: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    reports: list[GroupReport] = field(default_factory=list)
    learned: list[str] = field(default_factory=list)
    claims_asked: list[tuple[list[int], str | None]] = field(default_factory=list)
    beats: list[str] = field(default_factory=list)  # job ids, one per heartbeat
    lose_next_claim: bool = False  # the claim commits, then its answer is lost
    down: bool = False
    attempts_made: int = 0

    def _server(self) -> None:
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection "
                                       "refused.")

    def submit(self, job_id: str, job_class: str = BATCH, steps: int = 30,
               tokens: int = 1000, step_cache: float | None = None) -> None:
        self.queue.append(Queued(job_id, job_class, steps, tokens, step_cache))

    def claim(self, free: Sequence[int], running: Sequence[RunningJob], *, prefer: str,
              job_class: str | None) -> list[Claimed]:
        self._server()
        self.claims_asked.append((list(free), job_class))
        out = []
        for replica in free:
            fits = [q for q in self.queue if job_class in (None, q.job_class)]
            fits.sort(key=lambda q: q.job_class != prefer)
            if not fits:
                break
            q = fits[0]
            self.queue.remove(q)
            self.attempts_made += 1
            token = f"{q.job_id}-t{self.attempts_made}"
            self.running[q.job_id] = token
            if self.lose_next_claim:
                self.lose_next_claim = False
                raise RedisConnectionError("Connection closed by server.")
            request = VideoRequest(prompt=q.job_id, num_inference_steps=q.steps,
                                   step_cache=q.step_cache)
            out.append(Claimed(replica=replica, job_class=q.job_class, model="kiln-tiny",
                               tokens=q.tokens, attempt=1,
                               ticket=Ticket(job_id=q.job_id, attempt_token=token,
                                             request=request)))
        return out

    def interactive_due(self) -> bool:
        self._server()
        return any(q.job_class == INTERACTIVE for q in self.queue)

    def wait_for_work(self, seconds: float) -> None:
        self.clock.now += seconds

    def costs(self) -> CostModel:
        return CostModel()

    def heartbeat(self, job_id: str, token: str, *, step: int | None = None,
                  num_inference_steps: int | None = None) -> Beat | None:
        self._server()
        self.beats.append(job_id)
        if job_id in self.lost or self.running.get(job_id) != token:
            return None
        return Beat(cancel_requested=job_id in self.cancelled,
                    lease_expires_at=datetime.now(UTC))

    def finish(self, job_id: str, token: str, ending: Ending) -> str | None:
        self._server()
        if self.running.get(job_id) != token:
            return None
        del self.running[job_id]
        self.ended.append((job_id, token, ending))
        if ending.outcome == "failed" and ending.retryable and not ending.charged:
            return "queued"
        return ending.outcome

    def note(self, event: str, job_id: str, token: str, **fields: Any) -> None:
        self._server()
        self.notes.append((event, job_id, fields))

    def learn_cost(self, job_id: str, num_inference_steps: int, compute_seconds: float) -> None:
        self.learned.append(job_id)

    def report(self, report: GroupReport) -> None:
        self._server()
        self.reports.append(report)

    def attempts(self) -> list[Attempt]:
        self._server()
        return [Attempt(job_id=j, token=t, attempt=1, rank=0) for j, t in self.running.items()]

    def progress(self, job_id: str, attempt: int | None, step: int, steps: int) -> None:
        pass

    def forget(self, job_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class Group:
    """A coordinator (a latency group unless ``goal`` says otherwise) and the replicas' side of
    each turn, played from its plans: every job
    named in ``plan.run`` advances one step, taking ``step_seconds`` of the clock."""

    def __init__(self, dp: int = 2, **config: Any) -> None:
        self.clock = Clock()
        self.io = MemoryIO(self.clock)
        self.c = Coordinator(WorkerConfig(dp=dp, **config), Layout(dp=dp), "allgather", "cpu",
                             io=self.io, group_id="g", lease_seconds=60, clock=self.clock)
        self.steps: dict[str, int] = {}  # job id -> steps done
        self.tokens: dict[str, str] = {}
        self.total: dict[str, int] = {}
        self.step_seconds: dict[str, float] = {}
        self.plans: list[StepPlan] = []

    def plan(self, stop: bool = False) -> StepPlan:
        plan = self.c.next_plan(stop)
        self.plans.append(plan)
        for ticket in plan.assign.values():
            self.tokens[ticket.job_id] = ticket.attempt_token
            self.total[ticket.job_id] = ticket.request.num_inference_steps
            self.steps.setdefault(ticket.job_id, 0)
        for job_id in (*plan.drop, *plan.hand_back):
            self.steps.pop(job_id, None)
        return plan

    def turn(self, *, stop: bool = False, store_error: str | None = None) -> StepPlan:
        """One turn: the plan, the steps it runs, and every held job's message."""
        plan = self.plan(stop)
        messages: list[RankMessage] = [
            RankReport(rank=r, memory={"rank": r}, store_error=store_error)
            for r in range(self.c.world)]
        if plan.step:
            ran = set((plan.run or {}).values())
            self.clock.now += max((self.step_seconds.get(j, 1.0) for j in ran), default=0.0)
            for job_id in list(self.steps):
                computed = job_id in ran
                self.steps[job_id] += computed
                done = self.steps[job_id]
                spent = done * self.step_seconds.get(job_id, 1.0)
                if done < self.total[job_id]:
                    messages.append(self.progress(job_id, step=done, compute_seconds=spent,
                                                  computed=computed))
                    continue
                del self.steps[job_id]
                messages.append(Ended(rank=0, job_id=job_id, attempt_token=self.tokens[job_id],
                                      outcome="succeeded", step=done,
                                      num_inference_steps=done, compute_seconds=spent))
        self.c.record(messages)
        return plan

    def progress(self, job_id: str, **fields: Any) -> Progress:
        return Progress(rank=0, job_id=job_id, attempt_token=self.tokens[job_id],
                        num_inference_steps=self.total[job_id], **fields)


def test_free_replicas_are_given_queued_jobs_and_both_compute() -> None:
    g = Group(dp=2)
    g.io.submit("a")
    g.io.submit("b")
    plan = g.turn()
    assert {r: t.job_id for r, t in plan.assign.items()} == {0: "a", 1: "b"}
    assert plan.step and plan.run == {0: "a", 1: "b"}
    assert g.steps == {"a": 1, "b": 1}


def test_an_idle_group_waits_for_work_then_stops_after_its_idle_time() -> None:
    g = Group(dp=1, exit_when_idle_seconds=5.0)
    plan = g.plan()
    assert not plan.step and not plan.stop  # an idle tick: the ranks wait in a collective
    g.clock.now += 6
    assert g.plan().stop


def test_a_due_interactive_job_preempts_the_batch_job_with_the_most_work_left() -> None:
    g = Group(dp=2)
    g.io.submit("long", steps=100)
    g.io.submit("short", steps=40)
    g.turn()
    g.io.submit("i", INTERACTIVE, steps=4)
    plan = g.turn()
    assert {r: t.job_id for r, t in plan.assign.items()} == {0: "i"}
    assert g.io.claims_asked[-1] == ([0], INTERACTIVE)
    assert plan.run is not None and plan.run[0] == "i"
    assert ("preempted", "long", {"by_job": "i", "step": 1}) in g.io.notes
    while "i" in g.steps:
        g.turn()
    g.turn()  # the turn without a step, for the interactive job's files
    plan = g.turn()
    assert plan.run is not None and plan.run[0] == "long"
    continued = [n for n in g.io.notes if n[0] == "continued"]
    assert continued == [("continued", "long", {"step": 1})]
    assert [j for j, _, e in g.io.ended] == ["i"]


def test_at_their_own_pace_a_replica_of_one_rank_is_given_the_interactive_job_at_once() -> None:
    """It leaves its step part-way for the job (`runtime.rank_loop._Interrupt`): no hold."""
    g = Group(dp=2)
    g.c.own_pace = True  # what start(..., own_pace=True) sets, without the lease thread
    g.io.submit("long", steps=100)
    g.io.submit("short", steps=40)
    g.turn()
    g.io.submit("i", INTERACTIVE, steps=4)
    plan = g.plan()
    assert plan.hold == [] and {r: t.job_id for r, t in plan.assign.items()} == {0: "i"}
    assert g.io.claims_asked[-1] == ([0], INTERACTIVE)


def test_at_their_own_pace_the_replica_is_held_at_its_step_boundary_before_the_claim() -> None:
    g = Group(dp=2)
    g.c.own_pace = True  # what start(..., own_pace=True) sets, without the lease thread
    g.c.replicas_interrupt = False  # replicas of several ranks keep to step boundaries
    g.io.submit("long", steps=100)
    g.io.submit("short", steps=40)
    g.turn()
    g.io.submit("i", INTERACTIVE, steps=4)
    plan = g.plan()
    assert plan.hold == [0] and plan.assign == {}  # nothing claimed in the middle of a step
    assert g.c.next_plan(False).hold == []  # one hold at a time
    g.c.record([RankReport(rank=0, memory={"rank": 0}, waiting=True)])
    plan = g.plan()
    assert {r: t.job_id for r, t in plan.assign.items()} == {0: "i"}
    assert g.io.claims_asked[-1] == ([0], INTERACTIVE)
    assert plan.hold == [] and plan.run is not None and plan.run[0] == "i"


@pytest.mark.parametrize(("goal", "arriving"), [("throughput", INTERACTIVE), ("latency", BATCH)],
                         ids=["throughput group", "no interactive job due"])
def test_no_preemption_in_a_throughput_group_or_without_an_interactive_job_due(
        goal: str, arriving: str) -> None:
    g = Group(dp=1, goal=goal)
    g.io.submit("a", steps=50)
    g.turn()
    g.io.submit("b", arriving)
    for _ in range(3):
        plan = g.turn()
        assert not plan.assign and plan.run == {0: "a"}
    assert not [n for n in g.io.notes if n[0] == "preempted"]
    assert g.io.claims_asked == [([0], None)]  # the replica was never offered to "b"


def small_beside_big(*, big_steps: int, small_steps: int) -> tuple[Group, StepPlan]:
    """A dp=2 group: a batch job "big" of 5 s steps, measured, on replica 0; then an interactive
    job "small" (a fiftieth of its tokens, 0.1 s steps) arrives and takes replica 1. The plan of
    the turn that gave it."""
    g = Group(dp=2)
    g.io.submit("big", steps=big_steps)
    g.turn()
    g.step_seconds["big"] = 5.0
    g.turn()  # big's own step time is measured now
    g.io.submit("small", INTERACTIVE, steps=small_steps, tokens=20)
    g.step_seconds["small"] = 0.1
    return g, g.turn()


def test_a_dear_batch_job_sits_out_while_a_cheap_interactive_one_runs_beside_it() -> None:
    g, plan = small_beside_big(big_steps=50, small_steps=4)
    assert {r: t.job_id for r, t in plan.assign.items()} == {1: "small"}
    assert plan.run == {1: "small"}  # big sits out: it would pace the small job's steps


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_replicas_at_their_own_pace_each_run_their_job_and_a_partial_report_forgets_no_rank(
        platform) -> None:
    """On accelerators nobody sits out: no turn is shared, each replica has its own device. On
    the CPU the replicas share the host's cores: the dear batch job is paused while the
    interactive one runs, and named to run again once it is done."""
    g = Group(dp=2)
    g.c.own_pace = True  # what start(..., own_pace=True) sets, without the lease thread
    g.c.shares_cores = platform == "cpu"
    g.io.submit("big", steps=50)
    g.turn()
    g.step_seconds["big"] = 5.0
    g.turn()
    g.io.submit("small", INTERACTIVE, steps=4, tokens=20)
    g.step_seconds["small"] = 0.1
    plan = g.turn()
    if platform == "cpu":
        assert plan.run == {1: "small"} and plan.pause == [0]
        g.c.record([Rendered(rank=1, job_id="small", attempt_token=g.tokens["small"],
                             num_inference_steps=4)])
        g.plan()  # the turn in which "small"'s files are stored
        plan = g.plan()
        assert plan.run == {0: "big"} and plan.pause == []
    else:
        assert plan.run == {0: "big", 1: "small"} and plan.pause == []
    # A rank at its own pace reports on its own: the other's last report still counts.
    g.c.record([RankReport(rank=1, memory={"rank": 1}, takes_jobs=False)])
    g.c.record([RankReport(rank=0, memory={"rank": 0})])
    assert g.c.full_ranks == {1}


def test_a_job_sitting_turns_out_has_a_heartbeat_a_second_and_its_cancel_still_lands() -> None:
    g, _ = small_beside_big(big_steps=50, small_steps=1000)
    g.io.beats.clear()
    for _ in range(20):  # 2 s of the small job's turns, the big one sitting them out
        assert g.turn().run == {1: "small"}
    assert g.io.beats.count("small") == 20
    assert 2 <= g.io.beats.count("big") <= 3  # not one a turn: one a second
    g.io.cancelled.add("big")
    for _ in range(11):
        plan = g.turn()
        if "big" in plan.drop:
            break
    assert plan.drop == {"big": "cancelled by the user"}


def test_a_cancel_request_drops_the_job_at_the_next_step_boundary() -> None:
    g = Group(dp=1)
    g.io.submit("a")
    g.turn()
    g.io.cancelled.add("a")
    g.turn()  # its heartbeat carries the request
    plan = g.plan()
    assert plan.drop == {"a": "cancelled by the user"}
    assert not g.c.held


def test_a_job_whose_lease_was_lost_is_dropped() -> None:
    g = Group(dp=1)
    g.io.submit("a")
    g.turn()
    g.io.lost.add("a")
    g.turn()
    assert g.plan().drop == {"a": LEASE_LOST}


def test_a_rank_whose_store_fails_pauses_the_claims_and_the_group_says_why() -> None:
    g = Group(dp=1)
    g.turn(store_error="disk full")
    g.io.submit("a")
    plan = g.turn(store_error="disk full")
    assert not plan.assign and g.io.queue
    assert g.io.reports[-1].state == "degraded"
    assert "output store is failing" in (g.io.reports[-1].reason or "")
    g.turn()  # the store takes files again
    assert g.turn().run == {0: "a"}


def test_an_outage_pauses_claims_with_a_backoff_and_the_jobs_in_hand_go_on() -> None:
    g = Group(dp=2)
    g.io.submit("a")
    g.turn()
    g.io.down = True
    g.io.submit("b")
    for _ in range(3):
        plan = g.turn()  # nothing raises: the group degrades
        assert plan.run == {0: "a"}
    assert g.c.degraded is not None and "Connection refused" in g.c.degraded
    assert g.c._backoff > 0.5  # doubled by each failed claim
    g.io.down = False
    g.clock.now += 11  # past the longest backoff
    plan = g.turn()
    assert {t.job_id for t in plan.assign.values()} == {"b"}
    assert g.c.degraded is None and g.io.reports[-1].state == "ready"


def test_a_claim_whose_answer_an_outage_lost_goes_back_once_the_servers_answer() -> None:
    g = Group(dp=1)
    g.io.submit("a")
    g.io.lose_next_claim = True
    # The claim commits and its answer is lost; the next claim, after the backoff, gets an
    # answer: the servers are back, and the lost attempt goes back to the queue.
    plan = g.turn()
    assert not plan.assign and g.c.degraded is None and not g.io.running
    ended = {j: e for j, _, e in g.io.ended}
    assert ended["a"].code == "claim_lost" and not ended["a"].charged


def test_a_final_transition_an_outage_stops_is_tried_again_at_the_next_turn() -> None:
    g = Group(dp=1)
    g.io.submit("a", steps=2)
    g.turn()
    g.io.down = True
    g.turn()  # a's last step: its end cannot be written
    assert "a" in g.c.unfinished and not g.io.ended
    assert "a" in g.c.leases._attempts  # its lease is kept meanwhile
    g.io.down = False
    g.turn()
    assert [(j, e.outcome) for j, _, e in g.io.ended] == [("a", "succeeded")]
    assert not g.c.unfinished and g.io.learned == ["a"]


def test_a_stop_claims_nothing_more_then_hands_the_jobs_back_at_the_drain_deadline() -> None:
    g = Group(dp=1, drain_seconds=10.0)
    g.io.submit("a", steps=100)
    g.turn()
    g.io.submit("b")
    plan = g.turn(stop=True)
    assert plan.step and not plan.assign
    g.clock.now += 11
    g.c.leases.tick()  # the lease thread's turn: the drain is over
    assert g.c.leases.ended == {"a-t1": HANDED_BACK}
    plan = g.plan(stop=True)
    assert plan.hand_back == ["a"]  # its ranks checkpoint it as they let it go
    ((job, _, ending),) = g.io.ended
    assert job == "a" and ending.code == "worker_stopped" and not ending.charged
    assert g.plan(stop=True).stop


def test_an_interactive_job_that_rendered_has_a_turn_without_a_step_for_its_files() -> None:
    g = Group(dp=2)
    g.io.submit("big", steps=50)
    g.io.submit("i", INTERACTIVE, steps=2)
    g.turn()
    plan = g.plan()
    g.c.record([Rendered(rank=1, job_id="i", attempt_token=g.tokens["i"],
                         num_inference_steps=2)])
    plan = g.plan()
    assert not plan.step  # "i"'s replica stores its files before "big" steps again
    assert g.plan().step


def test_a_resumed_job_is_noted_once_with_the_step_it_resumed_from() -> None:
    g = Group(dp=1)
    g.io.submit("a", steps=30)
    g.plan()
    for step in (21, 22):
        g.c.record([g.progress("a", step=step, resumed_from_step=20, compute_seconds=1.0)])
    assert [n for n in g.io.notes if n[0] == "resumed"] == [("resumed", "a", {"step": 20})]
    assert g.c.held["a"].measured == pytest.approx(0.5)  # two steps of its own in 1 s


def test_a_batch_job_paused_past_the_bound_runs_next() -> None:
    g, _ = small_beside_big(big_steps=500, small_steps=1000)
    ran = []
    for _ in range(400):
        plan = g.turn()
        assert plan.run is not None
        ran.append("big" in plan.run.values())
        if any(ran):
            break
    assert any(ran), "the batch job waited forever"
    assert g.c.held["big"].held_job(g.clock()).paused_seconds == 0.0
    waited = ran.index(True) * 0.1
    assert 29.0 <= waited <= 31.0  # turns.TurnConfig.max_pause_seconds


def test_statuses_of_another_attempt_do_not_move_the_held_one() -> None:
    g = Group(dp=1)
    g.io.submit("a", steps=30)
    g.plan()
    g.c.record([Progress(rank=0, job_id="a", attempt_token="an-old-one", step=29,
                         num_inference_steps=30)])
    assert g.c.held["a"].steps_left == 30


def test_in_lock_step_a_batch_step_is_left_part_way_for_a_due_interactive_job() -> None:
    """Only a turn of batch work is leavable; rank 0 says leave once an interactive job is due
    (a replica can be given it), and the compute the ranks say the jobs lost counts against
    their budgets (a twentieth of a render's)."""
    g = Group(dp=2)
    g.io.submit("long", steps=100)
    g.io.submit("short", steps=40)
    g.step_seconds.update(long=2.0, short=2.0)
    assert g.turn().leavable
    plan = g.plan()  # a step of both, their step times measured now
    assert plan.leavable and not g.c.leave_step()  # nothing due
    g.io.submit("i", INTERACTIVE, steps=4, tokens=20)
    g.clock.now += 0.5
    assert g.c.leave_step()
    assert not g.c.leave_step()  # said once per step
    # The step left, the blocks it computed kept (`runtime.step_replay`): the ranks say what
    # it lost past them. The next plan gives the interactive job a replica, and its turns are
    # not leavable.
    g.c.record([g.progress(j, step=g.steps[j], computed=False, lost_seconds=0.1)
                for j in ("long", "short")])
    assert {h.ticket.job_id: h.lost_seconds for h in g.c.held.values()} == {"long": 0.1,
                                                                          "short": 0.1}
    plan = g.turn()
    assert {r: t.job_id for r, t in plan.assign.items()} == {0: "i"}
    assert plan.run == {0: "i"} and not plan.leavable


@pytest.mark.parametrize("caching", [False, True], ids=["exact", "caching"])
def test_a_batch_step_more_run_than_left_is_left_only_where_it_keeps_its_blocks(caching):
    """An exact job keeps the blocks its step computed: leaving loses the one under way. A
    caching job's step loses all it ran: leaving it more run than left would lose more
    compute than the wait it saves the interactive job."""
    g = Group(dp=1)
    g.io.submit("a", steps=10, step_cache=0.1 if caching else None)
    g.turn()  # its 1 s steps are measured now
    assert g.plan().leavable
    g.io.submit("i", INTERACTIVE, steps=4)
    g.clock.now += 0.55  # 0.45 s of the step is left
    assert g.c.leave_step() == (not caching)


@pytest.mark.parametrize("caching", [False, True], ids=["exact", "caching"])
def test_a_batch_step_about_to_end_is_left_only_where_it_keeps_its_blocks(caching) -> None:
    """An exact job's step loses at most the block under way: it is left however little of it
    is left. A caching job's step about to end is not (less than LEAVE_MIN_SECONDS left)."""
    g = Group(dp=1)
    g.io.submit("a", steps=10, step_cache=0.1 if caching else None)
    g.turn()
    assert g.plan().leavable
    g.io.submit("i", INTERACTIVE, steps=4)
    g.clock.now += 0.95  # less than LEAVE_MIN_SECONDS of it is left
    assert g.c.leave_step() == (not caching)


def test_a_batch_job_out_of_budget_for_left_steps_finishes_its_steps() -> None:
    g = Group(dp=1)
    g.io.submit("a", steps=10)
    g.turn()
    g.c.held["a"].lost_seconds = 0.5  # all of 10 steps x 1 s x 0.05
    assert not g.plan().leavable


@pytest.mark.parametrize("how", ["own pace", "throughput group", "outage"])
def test_no_step_is_left_at_their_own_pace_in_a_throughput_group_or_in_an_outage(how) -> None:
    g = Group(dp=1, goal="throughput" if how == "throughput group" else "latency")
    g.c.own_pace = how == "own pace"
    g.io.submit("a", steps=50)
    g.turn()
    plan = g.plan()
    g.io.submit("i", INTERACTIVE, steps=4)
    g.clock.now += 0.5
    assert plan.leavable == (how == "outage")
    g.io.down = how == "outage"
    assert not g.c.leave_step()
