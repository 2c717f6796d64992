"""Real servers on free local ports: the API under uvicorn (in a thread), a webhook receiver,
and the whole service with a real worker group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from api.app import create_app
from kiln.procs import free_port
from kiln.settings import Settings
from storage.users import create_api_key


class Server:
    """The API app served by uvicorn on a free port, in a thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the API did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int  # the status the receiver sent back


class Receiver:
    """A webhook endpoint on 127.0.0.1 that records every POST and answers ``fail_status`` to the
    first ``fail_first`` of them, 200 afterwards."""

    def __init__(self, *, fail_first: int = 0, fail_status: int = 500) -> None:
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

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"

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


@dataclass(frozen=True, slots=True)
class Service:
    url: str  # the API's base URL
    keys: dict[str, str]  # user name -> API key
    settings: Settings
    db: Any  # tests.conftest.Database


@contextlib.contextmanager
def running_service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path, *,
                    users: Sequence[str] = ("alice", "bob"), dp: int = 2) -> Iterator[Service]:
    """The API (uvicorn, in a thread) and a real ``kiln worker --dp N`` process group on the
    test's database and Redis prefix; yields once the worker group has reported ready."""
    env = {"KILN_DATABASE_URL": db.url, "REDIS_URL": "redis://127.0.0.1:6379/0",
           "KILN_REDIS_PREFIX": redis_prefix, "KILN_OUTPUT_DIR": str(tmp_path / "outputs")}
    settings = Settings(_env_file=None, database_url=db.url,  # type: ignore[call-arg]
                        redis_url=env["REDIS_URL"], redis_prefix=redis_prefix,
                        output_dir=tmp_path / "outputs")
    with db.session() as s:
        keys = {user: create_api_key(s, user).key for user in users}
    worker = subprocess.Popen([KILN, "worker", "--dp", str(dp)], env={**os.environ, **env},
                              start_new_session=True)
    try:
        # The test's own engine and client: closed by their fixtures, not left to the collector.
        app = create_app(settings, engine=db.engine, redis=redis_client)
        with Server(app) as url:
            _wait_until_ready(url, keys[users[0]], worker)
            yield Service(url, keys, settings, db)
    finally:
        os.killpg(worker.pid, signal.SIGINT)  # a graceful stop: running jobs finish or requeue
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def _wait_until_ready(url: str, key: str, worker: subprocess.Popen[bytes]) -> None:
    """Until the group has loaded its model and reported: a test that times what the worker
    does must not time its start-up."""
    deadline = time.monotonic() + 120
    headers = {"Authorization": f"Bearer {key}"}
    while not any(g["state"] == "ready"
                  for g in httpx.get(f"{url}/v1/workers", headers=headers).json()["data"]):
        assert worker.poll() is None, f"the worker exited with {worker.returncode}"
        assert time.monotonic() < deadline, "the worker group never reported ready"
        time.sleep(0.2)
