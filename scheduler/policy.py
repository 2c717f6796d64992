"""The batcher's policy: which queued job each free rank of a worker group starts next.

CPU bookkeeping only, in the manner of vLLM's scheduler: `Policy.add` / `Policy.remove` keep the
queue, `Policy.schedule(free_ranks, model=..., running=..., now=...)` returns a
`SchedulerOutput`, and `Policy.update_from_output` feeds back what finished jobs really cost. No
Redis, database or torch: `scheduler.claim` turns a plan into claims, tests and the simulator
drive it directly.

Order, for the model a group serves (a group never mixes models: its ranks share one set of
weights):

1. **Windows.** A job is not considered before its ``due`` time (``not_before``, else its
   submission). A job still queued at its ``deadline`` is listed in
   ``SchedulerOutput.expired`` and never assigned: the caller ends it as ``expired``,
   unrendered, with the reason.
2. **Levels (class, priority, aging).** A job's level is ``base + priority + waited // aging``,
   at most `TOP_LEVEL`: base 10 for interactive jobs, 0 for batch, priority 0-9, and one level
   more per ``aging_seconds`` waited since ``due``. Fresh interactive work (10-19) therefore goes
   before fresh batch work (0-9) and higher priority before lower; the highest level present is
   served first. That is the order of a group that prefers interactive work (the default); a
   group that prefers batch work (``schedule(..., prefer=BATCH)``: a worker group whose goal is
   throughput) swaps the bases (`class_bases`), so fresh batch work goes first for it. Either
   way a group takes the other class's jobs whenever none of its preferred class is due, and
   aging bounds the wait of both.
3. **Fairness within a level.** Among the users with a job at that level, the one with the least
   service in the job's class goes first (service = estimated render seconds of the jobs started
   for them, corrected by `update_from_output`). A user who had nothing queued in the class
   enters at the class's virtual time, the service level of the latest pick, so idle time is
   neither credit (no monopoly on return) nor debt (no penalty for last week's big batch). One
   user's 10,000 overnight prompts thus alternate with another user's 10 instead of going first.
4. **Cost-aware grouping.** From the chosen user's ``cost_window`` oldest jobs at that level the
   policy takes the one whose seconds per step is closest (in ratio) to the slowest job the
   group is already running: every rank steps at the pace of the slowest, so a small job beside
   a big one wastes the small one's rank, and a big one beside small ones slows them all.
   Grouping reorders only a user's own jobs at one level; it never overrides 1-3.
5. **No starvation.** At `TOP_LEVEL` (20, above any fresh job) fairness and grouping stop and
   the oldest ``due`` goes first. Bound: a job of level ``l`` reaches the top after at most
   ``(TOP_LEVEL - l) * aging_seconds``; from then on only top-level jobs that were due before it
   are served ahead of it, and those were all queued when it became due.

Admission is per rank, not per wave: `schedule` is called whenever ranks are free (at a step
boundary) with the jobs the other ranks are still running, so a rank whose job ended takes a new
one while the others go on.

State per call: the queue holds one heap per (model, class, priority, user), so `schedule` looks
at the heads of the non-empty queues (a few per user), not at every queued job. The claim path
builds a throwaway policy per call from the few candidates its Redis index returns
(`scheduler.queue_index.pick` applies the same order to choose them); the simulator keeps one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduler.cost import CostModel

INTERACTIVE = "interactive"
BATCH = "batch"
# Fresh interactive jobs sit at 10-19, fresh batch jobs at 0-9; aging lifts both up to TOP_LEVEL.
# That is for a group that prefers interactive work; `class_bases` gives any group's.
CLASS_BASE = {INTERACTIVE: 10, BATCH: 0}
# A worker group's goal, and the class of jobs it prefers: a latency group (replicas that split
# a job over sp ranks, finishing each sooner) takes interactive jobs first, a throughput group
# (many replicas of one rank) batch jobs first.
LATENCY, THROUGHPUT = "latency", "throughput"
GOAL_PREFERS = {LATENCY: INTERACTIVE, THROUGHPUT: BATCH}
MIN_PRIORITY, MAX_PRIORITY = 0, 9
TOP_LEVEL = 20

_QueueKey = tuple[str, str, int, str]  # model, class, priority, owner
_Entry = tuple[float, int, str]  # due, insertion sequence (FIFO among equal dues), job id


@dataclass(kw_only=True, slots=True)
class QueuedJob:
    job_id: str
    owner: str  # whose fair share the job draws on (the user id)
    model: str  # only a group serving this model may run it
    job_class: str = INTERACTIVE  # "interactive" | "batch"
    priority: int = 5  # 0-9, higher first within a class
    due: float  # Unix seconds from which it may start (not_before, else submission)
    deadline: float | None = None  # Unix seconds; still queued then -> expired
    num_tokens: int  # video tokens per forward (scheduler.cost.tokens)
    num_inference_steps: int  # denoising steps


@dataclass(kw_only=True, slots=True)
class RunningJob:
    job_id: str
    rank: int  # the rank rendering it
    model: str
    cost_per_step: float  # estimated seconds per step (CostModel.step_seconds for its tokens)
    steps_left: int  # steps still to run; 0: it ends at this boundary


@dataclass(kw_only=True, slots=True)
class JobResult:
    job_id: str
    model: str
    num_tokens: int
    num_inference_steps: int  # steps actually run
    render_seconds: float  # wall time of those steps


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    aging_seconds: float = 600.0  # a waiting job gains one level per this much waiting
    cost_window: int = 4  # how many of a user's oldest jobs at a level grouping may choose among

    def __post_init__(self) -> None:
        if not (self.aging_seconds > 0 and math.isfinite(self.aging_seconds)):
            raise ValueError(f"aging_seconds must be a positive number, got {self.aging_seconds}")
        if self.cost_window < 1:
            raise ValueError(f"cost_window must be >= 1, got {self.cost_window}")


@dataclass(slots=True)
class SchedulerOutput:
    # free rank -> id of the job to start on it at the next step boundary
    assignments: dict[int, str] = field(default_factory=dict)
    # queued jobs whose deadline passed before they could start: end them as expired
    expired: list[str] = field(default_factory=list)
    # assigned job id -> estimated seconds per step (what its RunningJob.cost_per_step will be)
    step_costs: dict[str, float] = field(default_factory=dict)


#: A group's goal when it declares none: interactive jobs first, the service's order, so a
#: deployment of one group keeps answering people before it works through batches. A pool for
#: overnight work declares ``throughput``.
DEFAULT_GOAL = LATENCY


def class_bases(prefer: str = INTERACTIVE) -> dict[str, int]:
    """Each class's base level for a group that prefers ``prefer``: the preferred class takes
    the highest base, the others keep their order below it (`CLASS_BASE` is
    ``class_bases(INTERACTIVE)``)."""
    if prefer not in CLASS_BASE:
        raise ValueError(f"prefer must be one of {sorted(CLASS_BASE)}, got {prefer!r}")
    bases = sorted(CLASS_BASE.values(), reverse=True)
    others = sorted((c for c in CLASS_BASE if c != prefer), key=CLASS_BASE.__getitem__,
                    reverse=True)
    return dict(zip([prefer, *others], bases, strict=True))


def level(job_class: str, priority: int, due: float, now: float, aging_seconds: float,
          bases: dict[str, int] = CLASS_BASE) -> int:
    waited = max(0.0, now - due)
    return min(TOP_LEVEL, bases[job_class] + priority + int(waited // aging_seconds))


class Policy:
    def __init__(self, config: PolicyConfig | None = None, costs: CostModel | None = None) -> None:
        self.config = config or PolicyConfig()
        self.costs = costs or CostModel()
        self._jobs: dict[str, QueuedJob] = {}
        self._seq_of: dict[str, int] = {}  # the live heap entry of each job (others are stale)
        self._seq = 0
        self._queues: dict[_QueueKey, list[_Entry]] = {}
        self._keys_by_model: dict[str, set[_QueueKey]] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        # (class, owner) -> service in estimated render seconds; and queued jobs per (class, owner)
        self._served: dict[tuple[str, str], float] = {}
        self._vtime: dict[str, float] = {}  # class -> service level of its latest pick
        self._num_queued: dict[tuple[str, str], int] = {}
        self._charged: dict[str, tuple[tuple[str, str], float]] = {}  # started job -> its charge

    # -- the queue ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def add(self, job: QueuedJob) -> None:
        if job.job_class not in CLASS_BASE:
            raise ValueError(f"job_class must be one of {sorted(CLASS_BASE)}, "
                             f"got {job.job_class!r}")
        if not MIN_PRIORITY <= job.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be {MIN_PRIORITY}-{MAX_PRIORITY}, got {job.priority}")
        if job.num_tokens <= 0 or job.num_inference_steps <= 0:
            raise ValueError("num_tokens and num_inference_steps must be positive, got "
                             f"{job.num_tokens}, {job.num_inference_steps}")
        if job.job_id in self._jobs:
            self.remove(job.job_id)
        share = (job.job_class, job.owner)
        if not self._num_queued.get(share):
            self._enter(share)
        self._num_queued[share] = self._num_queued.get(share, 0) + 1
        self._seq += 1
        self._jobs[job.job_id] = job
        self._seq_of[job.job_id] = self._seq
        key = (job.model, job.job_class, job.priority, job.owner)
        heapq.heappush(self._queues.setdefault(key, []), (job.due, self._seq, job.job_id))
        self._keys_by_model.setdefault(job.model, set()).add(key)
        if job.deadline is not None:
            heapq.heappush(self._deadlines, (job.deadline, self._seq, job.job_id))

    def add_many(self, jobs: Iterable[QueuedJob]) -> None:
        for job in jobs:
            self.add(job)

    def remove(self, job_id: str) -> QueuedJob | None:
        """Forgets a queued job (claimed elsewhere, cancelled); its heap entries go stale."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        del self._seq_of[job_id]
        share = (job.job_class, job.owner)
        self._num_queued[share] -= 1
        if not self._num_queued[share]:
            del self._num_queued[share]
        return job

    def served(self, job_class: str, owner: str) -> float:
        return self._served.get((job_class, owner), 0.0)

    def set_served(self, job_class: str, owner: str, seconds: float) -> None:
        """Loads a user's service from elsewhere (the claim path keeps it in Redis)."""
        self._served[(job_class, owner)] = seconds

    def _enter(self, share: tuple[str, str]) -> None:
        vtime = self._vtime.get(share[0], 0.0)
        if self._served.get(share, 0.0) < vtime:
            self._served[share] = vtime

    # -- scheduling -----------------------------------------------------------------------------

    def schedule(self, free_ranks: Sequence[int], *, model: str,
                 running: Sequence[RunningJob] = (), now: float,
                 prefer: str = INTERACTIVE) -> SchedulerOutput:
        """Jobs for ``free_ranks`` of a group serving ``model``, given what ``running`` ranks do.
        ``prefer``: the class the group serves first (`class_bases`).

        Assigned jobs leave the queue (and are charged to their user); if a claim then fails the
        caller simply drops it. Expired jobs of any model leave the queue too.
        """
        bases = class_bases(prefer)
        ranks = sorted(set(free_ranks))
        if any(r < 0 for r in ranks):
            raise ValueError(f"ranks must be >= 0, got {list(free_ranks)}")
        busy = {r.rank for r in running if r.steps_left > 0}
        if busy & set(ranks):
            raise ValueError(f"ranks {sorted(busy & set(ranks))} are both free and running")
        plan = SchedulerOutput()
        self._expire(now, plan)
        costs = [r.cost_per_step for r in running if r.steps_left > 0]
        for rank in ranks:
            job = self._pick(model, now, max(costs) if costs else None, bases)
            if job is None:
                break
            cost = self.costs.step_seconds(model, job.num_tokens)
            self._start(job, cost)
            plan.assignments[rank] = job.job_id
            plan.step_costs[job.job_id] = cost
            costs.append(cost)
        return plan

    def update_from_output(self, results: Iterable[JobResult]) -> None:
        """Learns seconds per step and replaces each user's estimated charge by the real one."""
        for r in results:
            if r.num_inference_steps > 0:
                self.costs.observe(r.model, r.num_tokens, r.render_seconds / r.num_inference_steps)
            charged = self._charged.pop(r.job_id, None)
            if charged is not None:
                share, estimate = charged
                self._served[share] = self._served.get(share, 0.0) + r.render_seconds - estimate

    def _start(self, job: QueuedJob, cost_per_step: float) -> None:
        self.remove(job.job_id)
        share = (job.job_class, job.owner)
        estimate = cost_per_step * job.num_inference_steps
        before = self._served.get(share, 0.0)
        self._vtime[job.job_class] = max(self._vtime.get(job.job_class, 0.0), before)
        self._served[share] = before + estimate
        self._charged[job.job_id] = (share, estimate)

    def _expire(self, now: float, plan: SchedulerOutput) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, job_id = heapq.heappop(self._deadlines)
            if self._seq_of.get(job_id) == seq:
                self.remove(job_id)
                plan.expired.append(job_id)

    def _live(self, entry: _Entry) -> bool:
        return self._seq_of.get(entry[2]) == entry[1]

    def _head(self, key: _QueueKey) -> _Entry | None:
        heap = self._queues[key]
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        if not heap:
            del self._queues[key]
            self._keys_by_model[key[0]].discard(key)
            return None
        return heap[0]

    def _pick(self, model: str, now: float, target: float | None,
              bases: dict[str, int]) -> QueuedJob | None:
        aging = self.config.aging_seconds
        heads: list[tuple[int, _QueueKey, _Entry]] = []
        for key in list(self._keys_by_model.get(model, ())):
            head = self._head(key)
            if head is None or head[0] > now:
                continue
            heads.append((level(key[1], key[2], head[0], now, aging, bases), key, head))
        if not heads:
            return None
        top = max(h[0] for h in heads)
        tops = [(key, head) for lvl, key, head in heads if lvl == top]
        if top == TOP_LEVEL:
            # The starvation bound: oldest first, nothing else counts.
            return self._jobs[min(tops, key=lambda t: t[1][:2])[1][2]]
        key, _ = min(tops, key=lambda t: (self._served.get((t[0][1], t[0][3]), 0.0), t[1][:2]))
        window = self._window(key, top, now, bases)
        if target is None or target <= 0 or len(window) == 1:
            return window[0]

        def mismatch(i: int) -> tuple[float, int]:
            cost = self.costs.step_seconds(model, window[i].num_tokens)
            return abs(math.log(max(cost, 1e-12) / target)), i

        return window[min(range(len(window)), key=mismatch)]

    def _window(self, key: _QueueKey, top: int, now: float,
                bases: dict[str, int]) -> list[QueuedJob]:
        """The oldest ``cost_window`` live jobs of one queue at level ``top``, oldest first."""
        heap = self._queues[key]
        taken: list[_Entry] = []
        while heap and len(taken) < self.config.cost_window:
            entry = heapq.heappop(heap)
            if not self._live(entry):
                continue
            if entry[0] > now or level(key[1], key[2], entry[0], now,
                                       self.config.aging_seconds, bases) < top:
                heapq.heappush(heap, entry)
                break
            taken.append(entry)
        for entry in taken:  # the caller removes the one it starts; the rest stay queued
            heapq.heappush(heap, entry)
        return [self._jobs[e[2]] for e in taken]
