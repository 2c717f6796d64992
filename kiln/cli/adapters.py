"""``kiln adapters add/list/rm``: LoRA adapters registered with the API (``/v1/adapters``), which
jobs then name (``kiln submit --adapter NAME[:SCALE]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kiln.cli.client import (
    DEFAULT_API_URL,
    ApiError,
    ApiKey,
    ApiUrl,
    Client,
    adapter_id,
    call,
    fail,
)

app = typer.Typer(no_args_is_help=True, help="LoRA adapters: register, list, delete.")


@app.command()
def add(
    file: Annotated[Path, typer.Argument(help="A LoRA .safetensors file (diffusers' format).")],
    name: Annotated[str | None, typer.Option(
        help="Its name (default: the file's name without .safetensors).",
        show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        help="The model it adapts (the deployment's default if left out).",
        show_default=False)] = None,
    shared: Annotated[bool, typer.Option("--shared", help="Admins: every user may use it.")]
    = False,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Register an adapter (checked by the API against the model) and print its id."""
    if not file.is_file():
        raise typer.BadParameter(f"{file}: no such file")
    fields = {"name": name or file.name.removesuffix(".safetensors")}
    if model is not None:
        fields["model"] = model
    if shared:
        fields["shared"] = "true"
    with open(file, "rb") as f:
        adapter = call(api, key, "POST", "/v1/adapters", data=fields,
                       files={"file": (file.name, f)})
    typer.echo(adapter["id"])


@app.command("list")
def list_(
    model: Annotated[str | None, typer.Option(help="Only the adapters for this model.",
                                              show_default=False)] = None,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Your adapters and the shared ones."""
    adapters = call(api, key, "GET", "/v1/adapters",
                    params={"model": model} if model else {})["data"]
    table = Table("NAME", "ID", "MODEL", "RANK", "SIZE", "SHARED", box=None)
    for a in adapters:
        table.add_row(a["name"], a["id"], a["model"], str(a["rank"]), f"{a['bytes']:,}",
                      "yes" if a["shared"] else "")
    Console(width=200).print(table)


@app.command()
def rm(
    name: Annotated[str, typer.Argument(help="The adapter's name or id.")],
    model: Annotated[str | None, typer.Option(help="Its model, where the name is not enough.",
                                              show_default=False)] = None,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Delete an adapter; jobs that name it and have not started fail."""
    with Client(api, key) as client:
        try:
            found = adapter_id(client, name, model)
            client.request("DELETE", f"/v1/adapters/{found}")
        except ApiError as exc:
            fail(exc)
    typer.echo(f"deleted {found}")
