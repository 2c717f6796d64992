"""``kiln batch``: submit a JSONL of jobs as one batch (optionally inside a nightly window), follow
it, and print its morning report, over the HTTP API.

Uses the HTTP client of `kiln.cli.client` (``--api`` / ``KILN_API_URL``, ``--key`` /
``KILN_API_KEY``, one-line errors with the API's reason, exit 1). `kiln.cli` adds this app as
the ``batch`` command group.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, time, timedelta, tzinfo
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kiln.cli.client import DEFAULT_API_URL, ApiKey, ApiUrl, call

app = typer.Typer(no_args_is_help=True, help="Overnight batches: submit a JSONL of jobs, "
                  "follow the batch, read its report.")

_WINDOW = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)-([01]?\d|2[0-3]):([0-5]\d)$")
_PROBLEM_STATES = ("failed", "expired", "dead")


def parse_window(text: str, now: datetime | None = None,
                 tz: tzinfo | None = None) -> tuple[datetime, datetime]:
    """``HH:MM-HH:MM`` in local clock time -> (not_before, deadline) in UTC: the next time the
    clock shows the start (after ``now``), and the first time after that it shows the end. ``tz``
    defaults to the machine's local time zone, daylight saving included."""
    match = _WINDOW.match(text.strip())
    if match is None:
        raise ValueError(f"expected START-END in 24-hour local time such as 22:00-06:00, "
                         f"got {text!r}")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    start_t, end_t = time(h1, m1), time(h2, m2)
    if start_t == end_t:
        raise ValueError(f"the window {text!r} starts and ends at the same time")
    now = now or datetime.now(UTC)

    def aware(wall: datetime) -> datetime:
        # A naive datetime's astimezone() reads it as the machine's local time (with its DST).
        return wall.replace(tzinfo=tz) if tz is not None else wall.astimezone()

    today = now.astimezone(tz).date() if tz is not None else now.astimezone().date()
    start = datetime.combine(today, start_t)
    if aware(start) <= now:
        start += timedelta(days=1)
    end = datetime.combine(start.date(), end_t)
    if end <= start:
        end += timedelta(days=1)
    return aware(start).astimezone(UTC), aware(end).astimezone(UTC)


def _local(stamp: str | None) -> str | None:
    if stamp is None:
        return None
    return datetime.fromisoformat(stamp).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


@app.command("submit")
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True,
                                         help="JSONL: one job (a POST /v1/jobs body) per line.")],
    window: Annotated[str | None, typer.Option(
        help="START-END in local clock time, e.g. 22:00-06:00: no job starts before the next "
             "START, and jobs not started by END expire.")] = None,
    defaults: Annotated[str | None, typer.Option(
        help='Job fields shared by every line, as JSON, e.g. \'{"num_inference_steps": 20}\'.')]
    = None,
    name: Annotated[str | None, typer.Option(help="A name for the batch.")] = None,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Submit every line of FILE as one batch and print its id.

    One bad line refuses them all; the error names the line and field."""
    form: dict[str, str] = {}
    if name is not None:
        form["name"] = name
    if defaults is not None:
        try:
            if not isinstance(json.loads(defaults), dict):
                raise ValueError
        except ValueError:
            raise typer.BadParameter("must be a JSON object", param_hint="--defaults") from None
        form["defaults"] = defaults
    if window is not None:
        try:
            not_before, deadline = parse_window(window)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--window") from None
        form["not_before"], form["deadline"] = not_before.isoformat(), deadline.isoformat()
    batch = call(api, key, "POST", "/v1/batches", data=form,
                 files={"file": (file.name, file.read_bytes(), "application/x-ndjson")})
    typer.echo(batch["id"])
    when = ""
    if batch.get("not_before"):
        when = f", from {_local(batch['not_before'])} until {_local(batch['deadline'])}"
    typer.echo(f"{batch['progress']['total']} jobs queued{when}", err=True)


@app.command("status")
def status(
    batch_id: Annotated[str, typer.Argument(metavar="ID", help="The batch id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Where a batch stands: jobs per state, progress, ETA, times."""
    batch = call(api, key, "GET", f"/v1/batches/{batch_id}")
    if as_json:
        typer.echo(json.dumps(batch, indent=2))
        return
    typer.echo(_status_text(batch))


def _status_text(batch: dict[str, Any]) -> str:
    progress = batch["progress"]
    counts = ", ".join(f"{n} {state}" for state, n in batch["counts"].items() if n)
    eta = None
    if batch.get("eta") is not None:
        eta = f"{_local(batch['eta'])} (in {timedelta(seconds=round(batch['eta_seconds']))})"
    lines = [
        ("id", batch["id"]),
        ("name", batch.get("name")),
        ("status", batch["status"]),
        ("jobs", counts),
        ("progress", f"{progress['finished']}/{progress['total']} finished, "
                     f"{100 * progress['step_fraction']:.1f}% of steps"),
        ("eta", eta),
        ("window", f"{_local(batch['not_before'])} - {_local(batch['deadline'])}"
         if batch.get("not_before") or batch.get("deadline") else None),
        ("created", _local(batch["created_at"])),
        ("started", _local(batch.get("started_at"))),
        ("finished", _local(batch.get("finished_at"))),
    ]
    return "\n".join(f"{label:>9}: {value}" for label, value in lines if value is not None)


@app.command("report")
def report(
    batch_id: Annotated[str, typer.Argument(metavar="ID", help="The batch id.")],
    every_job: Annotated[bool, typer.Option("--jobs", help="List every job with its links, not "
                                                           "only the problems.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """The morning report: outcomes, throughput, render time, failures with their reasons."""
    found = call(api, key, "GET", f"/v1/batches/{batch_id}/report")
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    _print_report(found, every_job, base_url=api.rstrip("/"))


def _print_report(rep: dict[str, Any], every_job: bool, *, base_url: str) -> None:
    console = Console(width=max(120, Console().width))
    counts = rep["counts"]
    summary = Table(box=None, show_header=False, pad_edge=False)
    summary.add_column(justify="right", style="bold")
    summary.add_column()
    summary.add_row("batch", f"{rep['id']}" + (f" ({rep['name']})" if rep.get("name") else ""))
    summary.add_row("jobs", str(rep["num_jobs"]))
    for state in ("succeeded", "failed", "expired", "cancelled", "dead", "queued", "running"):
        if counts.get(state) or state in ("succeeded", "failed", "expired", "cancelled"):
            summary.add_row(state, str(counts.get(state, 0)))
    per_hour = rep.get("videos_per_hour")
    summary.add_row("throughput", f"{per_hour:g} videos/hour" if per_hour is not None else "-")
    summary.add_row("render time", f"{rep['total_render_seconds']:.1f} s")
    if rep.get("active_seconds") is not None:
        summary.add_row("active", str(timedelta(seconds=round(rep["active_seconds"]))))
    summary.add_row("started", _local(rep.get("started_at")) or "-")
    summary.add_row("finished", _local(rep.get("finished_at")) or "-")
    console.print(summary)
    rows = rep["jobs"] if every_job else rep["problems"]
    if not rows:
        return
    table = Table(title="jobs" if every_job else "failed and expired jobs", title_justify="left")
    table.add_column("LINE", justify="right", no_wrap=True)
    table.add_column("ID", no_wrap=True, min_width=20)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("RENDER S", justify="right", no_wrap=True)
    table.add_column("VIDEO / REASON", overflow="fold", ratio=1)
    for job in rows:
        if job["status"] == "succeeded" and job.get("video_url"):
            detail = base_url + job["video_url"]
        else:
            detail = (job.get("error") or {}).get("message") or ""
        seconds = job.get("render_seconds")
        table.add_row(str(job.get("line") or ""), job["id"], job["status"],
                      f"{seconds:.1f}" if seconds is not None else "", detail)
    console.print(table)
