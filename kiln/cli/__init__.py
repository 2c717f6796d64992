"""The ``kiln`` command line: one entry point that starts everything.

Each module of this package holds one group of commands as a Typer app of its own; this one
adds them all to the root app, so no command module imports the app that includes it.
"""

from __future__ import annotations

import typer

from kiln.cli import batch, client, plan, render, service, up, worker

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kiln: batch video rendering "
                  "with diffusion transformers bigger than one accelerator.")
app.add_typer(client.app)  # submit, status, cancel, celery
app.add_typer(render.app)  # render, make-checkpoint
app.add_typer(service.app)  # db, keys, api
app.add_typer(up.app)  # up
app.add_typer(worker.app)  # worker
app.add_typer(plan.app)  # plan
app.add_typer(batch.app, name="batch")  # batch submit, status, report

if __name__ == "__main__":
    app()
