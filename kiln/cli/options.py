"""Options that several ``kiln`` commands take, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

Model = Annotated[str, typer.Option(help="kiln-tiny or a diffusers model directory.")]
Device = Annotated[str, typer.Option(help="cpu, cuda or npu.")]
