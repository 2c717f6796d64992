"""Options that several ``kiln`` commands take, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

from runtime.budget import parse_budget

Model = Annotated[str, typer.Option(help="kiln-tiny or a diffusers model directory.")]
Device = Annotated[str, typer.Option(help="cpu, cuda or npu.")]
DeviceBudgetOption = Annotated[str, typer.Option(
    "--device-budget",
    help="Device memory for resident transformer blocks (the rest stream): 'auto' (free device "
         "memory less the largest admitted job's activations; none on the CPU), 'none', or a "
         "size such as 12GiB.")]


def device_budget(text: str) -> int | str | None:
    """``--device-budget`` as ``runtime.budget`` takes it; a bad value is a usage error."""
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device-budget") from exc
