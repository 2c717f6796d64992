"""The ``kiln`` command line: one entry point that starts everything.

Each module of this package holds one group of commands as a Typer app of its own; this one
adds them all to the root app, so no command module imports the app that includes it.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from kiln.cli import batch, client, health, plan, render, service, up, worker

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
) -> None:
    pass


app.add_typer(client.app)  # submit, status, cancel, celery
app.add_typer(render.app)  # render, make-checkpoint
app.add_typer(service.app)  # db, keys, api
app.add_typer(health.app)  # health worker, health beat
app.add_typer(up.app)  # up
app.add_typer(worker.app)  # worker
app.add_typer(plan.app)  # plan
app.add_typer(batch.app, name="batch")  # batch submit, status, report

if __name__ == "__main__":
    app()
