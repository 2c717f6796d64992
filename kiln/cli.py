"""The ``kiln`` command line: one entry point that starts everything."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kiln: batch video rendering "
                  "with diffusion transformers bigger than one accelerator.")

import kiln.cli_batch  # noqa: E402,F401  (registers the batch group: submit, status, report)
import kiln.cli_client  # noqa: E402,F401  (registers submit, status, cancel and celery on app)
import kiln.cli_render  # noqa: E402,F401  (registers render and make-checkpoint on app)
import kiln.cli_service  # noqa: E402,F401  (registers db, keys and api on app)
import kiln.cli_up  # noqa: E402,F401  (registers up on app)
import kiln.cli_worker  # noqa: E402,F401  (registers worker on app)

if __name__ == "__main__":
    app()
