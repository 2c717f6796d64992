"""``kiln worker``: start a persistent worker group."""

from __future__ import annotations

from typing import Annotated

import typer

from common import logs
from common.settings import get_settings
from kiln.cli.options import (
    Device,
    DeviceBudgetOption,
    GoalOption,
    LayoutOption,
    Model,
    WeightsDtypeOption,
    WorldOption,
    device_budget,
    parse_goal,
    parse_layout,
    parse_weights_dtype,
)

app = typer.Typer()


@app.command()
def worker(
    dp: Annotated[int, typer.Option(
        help="Replicas in the group; each renders its own job.")] = 1,
    sp: Annotated[int, typer.Option(
        help="Ranks per replica: a job's token sequence is split over them (sequence "
             "parallelism); the group has dp x sp ranks, sharing one copy of the weights.")] = 1,
    model: Model = "kiln-tiny",
    device: Device = "cpu",
    allgather: Annotated[bool, typer.Option(
        help="Shard the block weights across the ranks (--no-allgather: rank-local).")] = True,
    drain_seconds: Annotated[float, typer.Option(
        min=0, help="On SIGINT/SIGTERM, how long the running jobs have to finish before they "
                    "go back to the queue, uncharged.")] = 45.0,
    collective_timeout_seconds: Annotated[float, typer.Option(
        min=1, help="A collective that takes longer than this means a rank hung: the group is "
                    "started again.")] = 600.0,
    budget: DeviceBudgetOption = "auto",
    weights_dtype: WeightsDtypeOption = "checkpoint",
    goal: GoalOption = None,
    layout: LayoutOption = "given",
    world: WorldOption = None,
) -> None:
    """Load the model once on dp x sp ranks, then render queued jobs until stopped (Ctrl-C)."""
    # Here, not at the top: torch and the model code load only for the command that needs them.
    from kiln.worker import WorkerConfig, run_worker

    if device not in ("cpu", "cuda", "npu"):
        raise typer.BadParameter(f"--device must be cpu, cuda or npu, got {device!r}")
    if dp < 1 or sp < 1:
        raise typer.BadParameter(f"--dp and --sp must be >= 1, got dp={dp}, sp={sp}")
    if layout == "auto" and device != "cpu":
        raise typer.BadParameter(f"--layout auto plans from a profile measured on CPU ranks; on "
                                 f"{device} give --dp and --sp", param_hint="--layout")
    config = WorkerConfig(dp=dp, sp=sp, goal=parse_goal(goal),
                          auto_world=parse_layout(layout, world, dp, sp, model),
                          device_budget=device_budget(budget),
                          weights_dtype=parse_weights_dtype(weights_dtype), model=model,
                          device=device, use_allgather=allgather,
                          drain_seconds=drain_seconds,
                          collective_timeout_seconds=collective_timeout_seconds)
    settings = get_settings()
    # The launcher's own lines (restarts, the attempts it ends); each rank configures its own,
    # with its rank (`kiln.worker.serve_rank`).
    logs.configure(settings.log_level, settings.log_format, process="worker")
    raise typer.Exit(run_worker(settings, config))
