"""Client commands of the ``kiln`` CLI (``submit``, ``status``, ``cancel``) over the HTTP API, and
``kiln celery``, which runs the side work in ``kiln.tasks``.

The client needs only the API's address (``--api`` / ``KILN_API_URL``) and a key (``--key`` /
``KILN_API_KEY``). Errors are one line on stderr with the API's reason; the exit status is 1 when
a request fails or a waited-for job does not succeed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from common.files import atomic_path
from common.settings import Settings

app = typer.Typer()


DEFAULT_API_URL = "http://127.0.0.1:8000"
_FINAL = frozenset({"succeeded", "failed", "cancelled", "dead", "expired"})

ApiUrl = Annotated[str, typer.Option(
    "--api", envvar="KILN_API_URL", help="Base URL of the kiln API.", show_default=True)]
ApiKey = Annotated[str | None, typer.Option(
    "--key", envvar="KILN_API_KEY", help="API key (kiln keys create).", show_default=False)]


class ApiError(Exception):
    """A request the API refused (``status`` set) or that never reached it."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return str(body["detail"])
    text = response.text.strip().splitlines()
    return text[0][:200] if text else response.reason_phrase


class Client:
    def __init__(self, base_url: str, key: str | None, *, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the API at {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            reason = _reason(response)
            if response.status_code == 401:
                reason += " (pass --key or set KILN_API_KEY)"
            raise ApiError(reason, response.status_code)
        return response

    def job(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}").json()

    def download(self, job_id: str, out: Path) -> int:
        """Streams the job's video into ``out`` (whole or not at all); returns its size."""
        try:
            with atomic_path(out, suffix=".part") as tmp, open(tmp, "wb") as f:
                # Redirects lead to presigned S3 URLs; httpx drops the key for another host.
                with self.http.stream("GET", f"/v1/jobs/{job_id}/video",
                                      follow_redirects=True) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise ApiError(_reason(response), response.status_code)
                    for chunk in response.iter_bytes():
                        f.write(chunk)
        except httpx.HTTPError as exc:
            raise ApiError(f"download failed: {exc}") from exc
        return out.stat().st_size


def fail(exc: ApiError) -> NoReturn:
    suffix = f" (HTTP {exc.status})" if exc.status is not None else ""
    typer.echo(f"error: {exc}{suffix}", err=True)
    raise typer.Exit(1)


def call(api: str, key: str | None, method: str, path: str, **kwargs: Any) -> Any:
    """One API request for a CLI command: the response's JSON, or a one-line error and exit 1."""
    with Client(api, key) as client:
        try:
            return client.request(method, path, **kwargs).json()
        except ApiError as exc:
            fail(exc)


def _size(value: str) -> tuple[int, int]:
    width, sep, height = value.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise typer.BadParameter(f"expected WIDTHxHEIGHT such as 512x288, got {value!r}",
                                 param_hint="--size")
    return int(width), int(height)


def _describe(job: dict[str, Any]) -> str:
    status = job["status"]
    if status == "queued":
        ahead = job.get("queue_position")
        return "queued" if ahead is None else f"queued, {ahead} ahead"
    if status == "running" and job.get("cancel_requested"):
        return "running, cancelling"
    return str(status)


def _wait(client: Client, job: dict[str, Any], poll: float) -> dict[str, Any]:
    """Polls until the job is final, with a live progress bar on stderr."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=False)
    with progress:
        bar = progress.add_task(_describe(job), total=job["total_steps"], completed=job["step"])
        while job["status"] not in _FINAL:
            time.sleep(poll)
            job = client.job(job["id"])
            progress.update(bar, description=_describe(job), total=job["total_steps"],
                            completed=job["step"])
    return job


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="What the video shows.")],
    size: Annotated[str | None, typer.Option(help="WIDTHxHEIGHT, e.g. 512x288.")] = None,
    frames: Annotated[int | None, typer.Option(min=1, help="Number of frames.")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Denoising steps.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Seed (drawn by the API if left out).")]
    = None,
    model: Annotated[str | None, typer.Option(help="Model (the deployment's default if left "
                                                   "out).")] = None,
    fps: Annotated[int | None, typer.Option(min=1, help="Frames per second.")] = None,
    webhook: Annotated[str | None, typer.Option(help="URL that gets a signed POST when the job "
                                                     "finishes.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress until the job finishes.")]
    = False,
    out: Annotated[Path | None, typer.Option(help="Save the video here (implies --wait).")]
    = None,
    poll: Annotated[float, typer.Option(min=0.05, help="Seconds between status checks.")] = 1.0,
    image: Annotated[Path | None, typer.Option(
        help="An image to start from (PNG, JPEG, WebP), for a model that takes one.")] = None,
    video: Annotated[Path | None, typer.Option(
        help="A video to start from (MP4, WebM), for a model that takes one.")] = None,
    fit: Annotated[str | None, typer.Option(
        help="How --image/--video is fitted to the size: crop (default), pad or stretch.")]
    = None,
    strength: Annotated[float | None, typer.Option(
        help="Video-to-video: how far the render moves from --video (1: pure noise).")] = None,
    quality: Annotated[str | None, typer.Option(
        help="exact (default), balanced or fast: fast skips blocks of steps that change "
             "little.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        help="A LoRA adapter to apply, NAME[:SCALE] (scale 1 if left out): one of yours or a "
             "shared one (kiln adapters list). Repeatable.", show_default=False)] = None,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Submit a job and print its id; --wait follows it to the end (exit 1 unless it succeeds).
    --image or --video is uploaded first (checked by the API) and the job starts from it."""
    wanted = [parse_adapter(text) for text in adapter or ()]
    if image is not None and video is not None:
        raise typer.BadParameter("give --image or --video, not both")
    source = image or video
    if source is not None and not source.is_file():
        raise typer.BadParameter(f"{source}: no such file")
    body: dict[str, Any] = {"prompt": prompt}
    if size is not None:
        body["width"], body["height"] = _size(size)
    for name, value in (("num_frames", frames), ("num_inference_steps", steps), ("seed", seed),
                        ("model", model), ("fps", fps), ("webhook_url", webhook),
                        ("fit", fit), ("strength", strength), ("quality", quality)):
        if value is not None:
            body[name] = value
    with Client(api, key) as client:
        try:
            if source is not None:
                with open(source, "rb") as file:
                    uploaded = client.request("POST", "/v1/files", data={
                        "purpose": "image" if image is not None else "video"},
                        files={"file": (source.name, file)}).json()
                body["input_file_id"] = uploaded["id"]
            if wanted:
                body["adapters"] = [{"id": adapter_id(client, name, model), "scale": scale}
                                    for name, scale in wanted]
            job = client.request("POST", "/v1/jobs", json=body).json()
            typer.echo(job["id"])
            if not (wait or out is not None):
                return
            try:
                job = _wait(client, job, poll)
            except KeyboardInterrupt:
                typer.echo(f"stopped waiting; the job goes on: kiln status {job['id']}", err=True)
                raise typer.Exit(130) from None
            if job["status"] != "succeeded":
                error = job.get("error") or {}
                reason = error.get("message") or job["status"]
                typer.echo(f"error: job {job['id']} {job['status']}: {reason}", err=True)
                raise typer.Exit(1)
            if out is not None:
                num_bytes = client.download(job["id"], out)
                typer.echo(f"saved {out} ({num_bytes} bytes)", err=True)
        except ApiError as exc:
            fail(exc)


def parse_adapter(text: str) -> tuple[str, float]:
    """``NAME[:SCALE]`` as (name, scale)."""
    name, sep, scale = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        value = float(scale) if sep else 1.0
    except ValueError:
        raise typer.BadParameter(f"expected NAME[:SCALE] such as squares:0.8, got {text!r}",
                                 param_hint="--adapter") from None
    if not name:
        raise typer.BadParameter(f"expected NAME[:SCALE], got {text!r}", param_hint="--adapter")
    return name, value


def adapter_id(client: Client, name: str, model: str | None) -> str:
    """The id of the adapter called ``name`` (for ``model``, when given): the caller's own
    before a shared one of the same name; an id is taken as it is."""
    found = client.request("GET", "/v1/adapters",
                           params={"model": model} if model else {}).json()["data"]
    if any(a["id"] == name for a in found):
        return name
    named = sorted((a for a in found if a["name"] == name), key=lambda a: a["shared"])
    if not named:
        raise ApiError(f"no adapter named {name!r}" + (f" for {model}" if model else "")
                       + " (kiln adapters list)")
    if len({a["model"] for a in named}) > 1:
        raise ApiError(f"adapters named {name!r} exist for several models; pass --model")
    return str(named[0]["id"])


@app.command()
def status(
    job_id: Annotated[str | None, typer.Argument(metavar="[ID]", help="A job id; left out: "
                                                 "your most recent jobs.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many recent jobs.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Show one job, or a table of recent jobs."""
    with Client(api, key) as client:
        try:
            if job_id is not None:
                job = client.job(job_id)
                typer.echo(json.dumps(job, indent=2) if as_json else _job_text(job))
                return
            jobs = client.request("GET", "/v1/jobs", params={"limit": limit}).json()["data"]
        except ApiError as exc:
            fail(exc)
    if as_json:
        typer.echo(json.dumps(jobs, indent=2))
    else:
        _job_table(jobs)


def _job_text(job: dict[str, Any]) -> str:
    lines = [
        ("id", job["id"]),
        ("status", _describe(job)),
        ("progress", f"{job['step']}/{job['total_steps']} steps"),
        ("model", job["model"]),
        ("video", f"{job['width']}x{job['height']}, {job['num_frames']} frames at "
                  f"{job['fps']} fps, seed {job['seed']}"),
        ("prompt", job["prompt"]),
        ("created", job["created_at"]),
        ("started", job.get("started_at")),
        ("finished", job.get("finished_at")),
        ("render seconds", job.get("render_seconds")),
        ("download", job.get("video_url")),
        ("error", (job.get("error") or {}).get("message")),
    ]
    return "\n".join(f"{name:>14}: {value}" for name, value in lines if value is not None)


def _job_table(jobs: list[dict[str, Any]]) -> None:
    if not jobs:
        typer.echo("no jobs")
        return
    table = Table(box=None, pad_edge=False)
    table.add_column("ID", no_wrap=True, min_width=20)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("STEPS", no_wrap=True, justify="right")
    table.add_column("MODEL", no_wrap=True)
    table.add_column("CREATED", no_wrap=True)
    table.add_column("PROMPT", no_wrap=True, overflow="ellipsis", ratio=1)
    for job in jobs:
        table.add_row(job["id"], _describe(job), f"{job['step']}/{job['total_steps']}",
                      job["model"], job["created_at"][:19].replace("T", " "), job["prompt"])
    Console(width=max(120, Console().width)).print(table)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job to cancel.")],
    api: ApiUrl = DEFAULT_API_URL,
    key: ApiKey = None,
) -> None:
    """Cancel a job: a queued one at once, a running one after its current step."""
    job = call(api, key, "POST", f"/v1/jobs/{job_id}/cancel")
    if job["status"] == "cancelled":
        typer.echo(f"cancelled {job_id}")
    else:
        typer.echo(f"cancel requested; {job_id} stops after its current step")


@app.command("celery")
def celery_(
    role: Annotated[str | None, typer.Argument(
        metavar="[worker|beat]",
        help="worker: run tasks; beat: only schedule the periodic ones. Left out: a worker "
             "with the beat embedded (one process, for a laptop).")] = None,
    beat: Annotated[bool | None, typer.Option(
        "--beat/--no-beat", help="Embed the beat in the worker (default: only when no role is "
                                 "given). Run exactly one beat per deployment.",
        show_default=False)] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 2,
    loglevel: Annotated[str | None, typer.Option(
        help="DEBUG, INFO, WARNING, ... (default: KILN_LOG_LEVEL, else INFO).",
        show_default=False)] = None,
) -> None:
    """Run the side work: webhooks, the lease reaper, Redis reconciliation, retention.

    Production runs `kiln celery worker` (as many as needed) and one `kiln celery beat`.
    """
    settings = Settings()
    if settings.redis_url is None:
        raise typer.BadParameter(
            "no Redis configured: set REDIS_URL (or use `kiln up`, which starts one)")
    if role not in (None, "worker", "beat"):
        raise typer.BadParameter(f"expected worker or beat, got {role!r}", param_hint="ROLE")
    if role == "beat" and beat is False:
        raise typer.BadParameter("--no-beat contradicts the beat role")

    # Here, not at the top: Celery and the database layer load only for `kiln celery`.
    from kiln.tasks import beat_schedule_path, make_celery

    celery_app = make_celery(settings)
    # Celery's own option, its logging being kiln's (kiln.tasks: the setup_logging signal).
    loglevel = loglevel or settings.log_level
    if role == "beat":
        argv = ["beat", f"--loglevel={loglevel}"]
    else:
        embed = beat if beat is not None else role is None
        argv = ["worker", f"--loglevel={loglevel}", f"--concurrency={concurrency}"]
        if embed:
            argv.append("--beat")
    if "beat" in argv or "--beat" in argv:
        beat_schedule_path(settings).parent.mkdir(parents=True, exist_ok=True)
    celery_app.start(argv)
