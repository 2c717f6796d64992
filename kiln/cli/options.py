"""Options that several ``kiln`` commands take, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

from common.families import FAMILIES, TINY_MODEL, family_of
from runtime.budget import WEIGHTS_DTYPES, parse_budget
from scheduler.policy import GOAL_PREFERS

Model = Annotated[str, typer.Option(help="kiln-tiny or a diffusers model directory.")]
Device = Annotated[str, typer.Option(help="cpu, cuda or npu.")]
DeviceBudgetOption = Annotated[str, typer.Option(
    "--device-budget",
    help="Device memory for resident transformer blocks (the rest stream): 'auto' (free device "
         "memory less the largest admitted job's activations; on the CPU every block when "
         "rank-local, bound to the shared checkpoint mapping, none with allgather), 'none', or "
         "a size such as 12GiB.")]
WeightsDtypeOption = Annotated[str, typer.Option(
    "--weights-dtype",
    help="What the group keeps and moves its streamed transformer blocks in: 'checkpoint' (as "
         "the checkpoint stores them), 'bf16' (half of fp32's bytes) or 'fp8' (e4m3 weights "
         "with a scale per output channel, biases and norms in bf16: about a quarter). Cast "
         "once at load and upcast before each block's forward: the host copy and the bytes "
         "copied and gathered per step shrink by that ratio, at some precision.")]

GoalOption = Annotated[str | None, typer.Option(
    help="What the worker group serves for: 'latency' takes interactive jobs first, "
         "'throughput' batch jobs first; either takes the other class's jobs when none of its "
         "own is queued. Default: latency (interactive first); a pool for overnight work "
         "declares throughput.",
    show_default=False)]


LayoutOption = Annotated[str, typer.Option(
    help="'given': --dp and --sp as given; 'auto': the layout planner (kiln plan) chooses dp, sp "
         "and the mode for --world ranks by --goal, from a profile of this machine and model.")]
WorldOption = Annotated[int | None, typer.Option(
    min=1, help="With --layout auto: the ranks to plan for (default: dp x sp).",
    show_default=False)]


def parse_layout(layout: str, world: int | None, dp: int, sp: int,
                 model: str = TINY_MODEL) -> int | None:
    """The ranks ``--layout auto`` plans for, or None for the layout given; ``--sp`` > 1 only
    for a model whose family splits a job's sequence (`Family.sequence_parallel`)."""
    family = family_of(model)
    if sp > 1 and family.pipeline is not None and not family.sequence_parallel:
        splits = ", ".join(f.name for f in FAMILIES if f.sequence_parallel)
        raise typer.BadParameter(f"{family.name} runs at --sp 1; sequence parallelism renders "
                                 f"{splits}", param_hint="--sp")
    if layout not in ("given", "auto"):
        raise typer.BadParameter(f"--layout is 'given' or 'auto', got {layout!r}",
                                 param_hint="--layout")
    if layout == "given":
        if world is not None and world != dp * sp:
            raise typer.BadParameter(f"--world {world} is not --dp {dp} x --sp {sp}; with "
                                     "--layout auto the planner chooses them",
                                     param_hint="--world")
        return None
    return world or dp * sp


def parse_goal(value: str | None) -> str | None:
    """``--goal`` as the worker takes it; a bad value is a usage error."""
    if value is not None and value not in GOAL_PREFERS:
        raise typer.BadParameter(f"must be {' or '.join(sorted(GOAL_PREFERS))}, got {value!r}",
                                 param_hint="--goal")
    return value


def parse_weights_dtype(text: str) -> str:
    """``--weights-dtype`` as ``apply_dlo`` takes it; a bad value is a usage error."""
    if text not in WEIGHTS_DTYPES:
        raise typer.BadParameter(f"must be {', '.join(WEIGHTS_DTYPES)}, got {text!r}",
                                 param_hint="--weights-dtype")
    return text


def device_budget(text: str) -> int | str | None:
    """``--device-budget`` as ``runtime.budget`` takes it; a bad value is a usage error."""
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device-budget") from exc
