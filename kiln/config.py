"""The worker group's settings of its own (``kiln worker``'s options), beside `common.settings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.budget import AUTO, DeviceBudget
from runtime.sequence import Layout
from scheduler.policy import DEFAULT_GOAL, GOAL_PREFERS


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    dp: int = 1  # replicas, each rendering its own job
    sp: int = 1  # ranks per replica, splitting its job's token sequence
    # "latency": interactive jobs first; "throughput": batch jobs first (either takes the other
    # class when its own is not queued). None: latency.
    goal: str | None = None
    # Device memory for resident blocks: "auto", None (stream all) or bytes (runtime.budget).
    device_budget: DeviceBudget = AUTO
    # The dtype the group keeps and moves its streamed blocks in (runtime.budget's
    # WEIGHTS_DTYPES): the group's choice, never a job's.
    weights_dtype: str = "checkpoint"
    # --layout auto: plan dp, sp and the mode for this many ranks (`plan_layout`); the plan it
    # chose (the layout and the runner-up, predicted) is reported to /v1/workers.
    auto_world: int | None = None
    plan: dict[str, Any] | None = None
    model: str = "kiln-tiny"
    device: str = "cpu"  # cpu | cuda | npu
    use_allgather: bool = True
    # Replicas step at their own pace where the weights allow it (no gathers: rank-local,
    # every block resident); False: the group turns in lock-step whatever the mode.
    own_pace: bool = True
    poll_seconds: float = 0.05  # longest an idle coordinator waits for a wake before it looks
    idle_tick_seconds: float = 1.0  # longest an idle rank waits in a collective
    report_seconds: float = 2.0  # how often the group reports itself (memory, current jobs)
    exit_when_idle_seconds: float | None = None  # stop after this long without work (tests)
    # After a stop is asked for (SIGINT, SIGTERM), the running jobs have this long to finish;
    # then they are handed back, uncharged, and the ranks leave. docker-compose.yml gives the
    # worker a stop grace period above it.
    drain_seconds: float = 45.0
    # Every collective on the ranks returns or raises within this: a hung rank makes its peers
    # raise, and the group is started again. Above the longest step the admission rules let in.
    collective_timeout_seconds: float = 600.0
    max_restarts: int = 5  # rank set restarts allowed within restart_window_seconds
    restart_window_seconds: float = 600.0
    group_id: str = ""  # given by the launcher to each rank set it starts; new one if empty
    name: str = ""

    def __post_init__(self) -> None:
        if self.goal is not None and self.goal not in GOAL_PREFERS:
            raise ValueError(f"goal must be one of {sorted(GOAL_PREFERS)}, got {self.goal!r}")

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, sp=self.sp)

    def goal_for(self, layout: Layout) -> str:
        """The goal the group serves by: the declared one, else interactive jobs first."""
        return self.goal or DEFAULT_GOAL

