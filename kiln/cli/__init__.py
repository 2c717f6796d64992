"""The ``kiln`` command line: one entry point that starts everything.

Each module of this package holds one group of commands as a Typer app of its own; this one
adds them all to the root app, so no command module imports the app that includes it.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from typing import Annotated, Literal

import typer

from kiln.cli import adapters, batch, client, health, plan, render, service, up, worker

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kiln: batch video rendering "
                  "with diffusion transformers bigger than one accelerator.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kiln {version('kiln')}")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the installed version (pyproject.toml's, from the package metadata) and "
             "exit.")] = False,
    log_format: Annotated[Literal["text", "json"] | None, typer.Option(
        help="Log lines as text or JSON (one object a line, for a log shipper); default: "
             "KILN_LOG_FORMAT, else text.", show_default=False)] = None,
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None, typer.Option(
        help="The least level logged; default: KILN_LOG_LEVEL, else INFO.",
        show_default=False)] = None,
) -> None:
    # Into the environment, where the settings read them: `kiln up`'s children and a worker's
    # ranks are processes of their own, and inherit it.
    if log_format is not None:
        os.environ["KILN_LOG_FORMAT"] = log_format
    if log_level is not None:
        os.environ["KILN_LOG_LEVEL"] = log_level


app.add_typer(client.app)  # submit, status, cancel, celery
app.add_typer(render.app)  # render, make-checkpoint
app.add_typer(service.app)  # db, keys, api
app.add_typer(health.app)  # health worker, health beat
app.add_typer(up.app)  # up
app.add_typer(worker.app)  # worker
app.add_typer(plan.app)  # plan
app.add_typer(batch.app, name="batch")  # batch submit, status, report
app.add_typer(adapters.app, name="adapters")  # adapters add, list, rm

if __name__ == "__main__":
    app()
