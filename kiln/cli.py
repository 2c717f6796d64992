"""The ``kiln`` command line: one entry point that starts everything."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kiln: batch video rendering "
                  "with diffusion transformers bigger than one accelerator.")

if __name__ == "__main__":
    app()
