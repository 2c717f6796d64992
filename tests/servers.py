"""Real servers on free local ports: the API under uvicorn (in a thread), a webhook receiver,
and the whole service with a real worker group."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import uvicorn
from typer.testing import CliRunner

from api.app import create_app
from common.procs import free_port, stop_group
from common.settings import Settings
from kiln.cli import app as cli
from storage.outputs import OutputStore
from storage.users import create_api_key


class Server:
    """An app served by uvicorn in a thread, on a free 127.0.0.1 port that is bound before the
    server starts (nothing else can take it in between); ``config`` goes to ``uvicorn.Config``.
    Entering yields the base URL once the server accepts connections."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        self.config = {"log_level": "warning", **config}

    def __enter__(self) -> str:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, **self.config)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.sock.close()
                raise TimeoutError("the API did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int  # the status the receiver sent back


class Receiver:
    """A webhook endpoint on ``host`` (127.0.0.1) that records every POST and answers
    ``fail_status`` to the first ``fail_first`` of them, 200 afterwards."""

    def __init__(self, *, fail_first: int = 0, fail_status: int = 500,
                 host: str = "127.0.0.1") -> None:
        self.requests: list[Received] = []
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.arrived:
                    failing = len(receiver.requests) < receiver.fail_first
                    answer = receiver.fail_status if failing else 200
                    receiver.requests.append(Received(self.path, dict(self.headers.items()),
                                                      body, answer))
                    receiver.arrived.notify_all()
                self.send_response(answer)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass  # keep test output clean

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/hook"

    def wait_for(self, count: int, timeout: float = 30) -> list[Received]:
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(f"{len(self.requests)} of {count} webhook requests arrived")
            return list(self.requests)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


KILN = str(Path(sys.executable).with_name("kiln"))
REDIS_URL = "redis://127.0.0.1:6379/0"
runner = CliRunner()


@dataclass(frozen=True, slots=True)
class Service:
    url: str  # the API's base URL
    keys: dict[str, str]  # user name -> API key
    settings: Settings
    db: Any  # tests.conftest.Database
    store: OutputStore  # the API's output store

    def kiln(self, *args: str, who: str = "alice") -> Any:
        """The ``kiln`` CLI (in this process) against this API with ``who``'s key."""
        return runner.invoke(cli, [*args, "--api", self.url, "--key", self.keys[who]])


@contextlib.contextmanager
def serving_api(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, *,
                users: Sequence[str] = ("alice", "bob"), **overrides: Any) -> Iterator[Service]:
    """The API alone (uvicorn, in a thread) on the test's database, Redis client and prefix, with
    outputs under ``tmp_path`` and an API key for each of ``users``; ``overrides`` add to or
    replace the ``Settings`` fields."""
    values: dict[str, Any] = {"database_url": db.url, "redis_url": REDIS_URL,
                              "redis_prefix": redis_prefix, "output_dir": tmp_path / "outputs",
                              **overrides}
    settings = Settings(_env_file=None, **values)  # type: ignore[call-arg]
    with db.session() as s:
        keys = {user: create_api_key(s, user).key for user in users}
    # The test's own engine and client: closed by their fixtures, not left to the collector.
    app = create_app(settings, engine=db.engine, redis=redis_client)
    with Server(app) as url:
        yield Service(url, keys, settings, db, app.state.store)


@contextlib.contextmanager
def running_service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, *,
                    users: Sequence[str] = ("alice", "bob"), dp: int = 2, sp: int = 1,
                    **overrides: Any) -> Iterator[Service]:
    """The API (``serving_api``) and a real ``kiln worker --dp N --sp M`` process group
    (``worker_group``) on the test's database and Redis prefix; yields once the worker group has
    reported ready. ``overrides`` (scalar ``Settings`` fields) go to both."""
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=users,
                     **overrides) as service, worker_group(service, dp=dp, sp=sp, **overrides):
        yield service


@contextlib.contextmanager
def worker_group(service: Service, *, dp: int = 2, sp: int = 1, goal: str | None = None,
                 args: Sequence[str] = (), **overrides: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``kiln worker --dp N --sp M`` (N replicas of M ranks) in a process group of its
    own (the launcher is its leader) on ``service``'s database, Redis prefix and outputs;
    ``goal``: its ``--goal`` (None: the layout's default); ``overrides`` (scalar ``Settings``
    fields) reach it as ``KILN_*`` variables; ``args`` are more ``kiln worker`` options. Yields
    the launcher once a group that was not there before has reported ready; leaving stops the
    group gracefully, unless the test has killed it already."""
    key = next(iter(service.keys.values()))
    before = {g["id"] for g in _groups(service.url, key)}
    goal_args = ["--goal", goal] if goal is not None else []
    worker = subprocess.Popen([KILN, "worker", "--dp", str(dp), "--sp", str(sp), *goal_args,
                               *args],
                              env=worker_env(service, **overrides),
                              start_new_session=True)
    try:
        _wait_until_ready(service.url, key, worker, before)
        yield worker
    finally:
        # A graceful stop (running jobs finish or requeue); a killed group is gone already.
        stop_group(worker, timeout=60)


def worker_env(service: Service, **overrides: Any) -> dict[str, str]:
    """The environment a ``kiln worker`` process of ``service`` runs in: this one's, plus its
    database, Redis, Redis prefix and outputs, and ``overrides`` (scalar ``Settings`` fields) as
    ``KILN_*`` variables."""
    s = service.settings
    env = {"KILN_DATABASE_URL": s.database_url, "REDIS_URL": s.redis_url or REDIS_URL,
           "KILN_REDIS_PREFIX": s.redis_prefix, "KILN_OUTPUT_DIR": str(s.output_dir),
           **{f"KILN_{name.upper()}": str(value) for name, value in overrides.items()}}
    return {**os.environ, **env}


def _groups(url: str, key: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/workers", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return list(r.json()["data"])


def _wait_until_ready(url: str, key: str, worker: subprocess.Popen[bytes],
                      before: set[str]) -> None:
    """Until the new group has loaded its model and reported: a test that times what the worker
    does must not time its start-up. Groups in ``before`` (one killed earlier still looks
    ready) do not count."""
    deadline = time.monotonic() + 120
    while not any(g["state"] == "ready" and g["id"] not in before
                  for g in _groups(url, key)):
        assert worker.poll() is None, f"the worker exited with {worker.returncode}"
        assert time.monotonic() < deadline, "the worker group never reported ready"
        time.sleep(0.2)


def api_client(service: Service, user: str = "alice") -> httpx.Client:
    """An HTTP client for ``service``'s API with ``user``'s key."""
    return httpx.Client(base_url=service.url, timeout=30,
                        headers={"Authorization": f"Bearer {service.keys[user]}"})


def wait_job(client: httpx.Client, job_id: str, until: Any,
             timeout: float = 120) -> dict[str, Any]:
    """Polls ``GET /v1/jobs/{job_id}`` until ``until(job)``; the job as it then was."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if until(job):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def job_row(service: Service, job_id: str) -> Any:
    """The job's row as the database has it now (detached)."""
    from storage.tables import Job

    with service.db.session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def up_env() -> dict[str, str]:
    """This environment without kiln's settings, as `kiln_up` runs in: ``kiln`` commands run
    with it in the same directory reach the same database and data directory."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("KILN_") and k not in ("REDIS_URL", "DATABASE_URL")}


@contextlib.contextmanager
def kiln_up(tmp_path: Path, *args: str, celery: bool = False,
            kiln_options: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """``kiln *kiln_options up *args`` in ``tmp_path`` on a free API port, in a process group of
    its own, with ``--no-celery`` unless ``celery``; yields (the API's base URL, the admin key)
    once the API answers, and stops it on leaving."""
    port = free_port()
    env = {**up_env(), "KILN_API_PORT": str(port)}
    extra = [] if celery else ["--no-celery"]
    proc = subprocess.Popen([KILN, *kiln_options, "up", *args, *extra], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        key_file = tmp_path / "var" / "admin.key"
        deadline = time.monotonic() + 120
        while not key_file.exists() or not answers(f"{base}/healthz"):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "kiln up did not come up"
            time.sleep(0.2)
        yield base, key_file.read_text().strip()
    finally:
        stop_group(proc, timeout=90)
        if proc.stdout:
            proc.stdout.close()


def decoded(path: Path) -> np.ndarray:
    """A stored MP4's frames, RGB, as one array [frames, height, width, 3]."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
