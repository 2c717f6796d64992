"""`kiln up` supervises its children, with real processes and real servers: a worker group or a
Celery process killed outright comes back while the API keeps answering; a dead API or private
Redis comes back on the same address; a child that fails at every start stops `kiln up` with a
plain message and exit status 1. The children's output goes to one file each under var/logs/."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis
from redis.exceptions import RedisError
from servers import KILN, answers

from common.procs import free_port, stop_group

JOB = {"prompt": "a red circle moving left", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4, "seed": 7}


class Up:
    """``kiln up ARGS`` in ``cwd`` on embedded defaults, its output collected line by line."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.cwd = cwd
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KILN_") and k not in ("REDIS_URL", "DATABASE_URL")}
        env["KILN_API_PORT"] = str(self.port)
        self.proc = subprocess.Popen([KILN, "up", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 60, after: int = 0) -> re.Match[str]:
        """The first line from index ``after`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            ended = not self.reader.is_alive()
            for line in self.lines[after:]:
                if found := re.search(pattern, line):
                    return found
            assert not ended and time.monotonic() < deadline, \
                f"no line matches {pattern!r}:\n{self.output}"
            time.sleep(0.1)

    def wait_up(self, timeout: float = 120) -> dict[str, str]:
        """Waits for the API and the admin key; the headers that carry the key."""
        key_file = self.cwd / "var" / "admin.key"
        deadline = time.monotonic() + timeout
        while not key_file.exists() or not answers(f"{self.base}/healthz"):
            assert self.proc.poll() is None, self.output
            assert time.monotonic() < deadline, f"kiln up did not come up:\n{self.output}"
            time.sleep(0.2)
        # kiln up's own start-up is over (it supervises from here on), not just the API's.
        self.wait_line(r"^Ctrl-C stops everything\.", timeout=max(1.0, deadline - time.monotonic()))
        return {"Authorization": f"Bearer {key_file.read_text().strip()}"}

    def child(self, name: str) -> int:
        """The pid of the running child whose command is ``kiln NAME`` (or, for redis, the
        redis-server)."""
        pid = self.proc.pid
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            words = [Path(a.decode()).name for a in argv if a]
            if (name == "redis" and words and words[0].startswith("redis-server")) or (
                    len(words) > 2 and words[2] == name):
                return int(child)
        raise AssertionError(f"no running {name} child under kiln up")

    def log(self, name: str) -> str:
        return (self.cwd / "var" / "logs" / f"{name}.log").read_text(errors="replace")

    def stop(self) -> int:
        stop_group(self.proc, timeout=90)
        self.reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


class Probe:
    """Asks ``url`` every 0.1 s from a thread of its own; ``failures`` are the answers that were
    not 200 (or did not come)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.asked = 0
        self.failures: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            self.asked += 1
            try:
                status = httpx.get(self.url, timeout=5).status_code
                if status != 200:
                    self.failures.append(str(status))
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def _ready_groups(up: Up, headers: dict[str, str]) -> set[str]:
    groups = httpx.get(f"{up.base}/v1/workers", headers=headers, timeout=30).json()["data"]
    return {g["id"] for g in groups if g["state"] == "ready" and not g["stale"]}


def _wait_for_new_group(up: Up, headers: dict[str, str], old: set[str],
                        timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not (new := _ready_groups(up, headers) - old):
        assert time.monotonic() < deadline, f"no new ready worker group:\n{up.output}"
        time.sleep(0.2)
    return new.pop()


def _render(up: Up, headers: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    created = httpx.post(f"{up.base}/v1/jobs", json=JOB, headers=headers, timeout=30)
    assert created.status_code == 201, created.text
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{up.base}/v1/jobs/{created.json()['id']}", headers=headers,
                        timeout=30).json()
        if job["status"] in ("succeeded", "failed", "dead"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for init to reap does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_killed_worker_group_and_celery_come_back_while_the_api_answers(
        tmp_path: Path) -> None:
    up = Up(tmp_path, "--dp", "1")
    try:
        headers = up.wait_up()
        first = _wait_for_new_group(up, headers, set())
        probe = Probe(f"{up.base}/healthz")
        seen = len(up.lines)
        worker = up.child("worker")
        os.kill(worker, signal.SIGKILL)
        up.wait_line(r"worker exited with code -9 \(killed by SIGKILL\) after .*; restarting "
                     r"in 1 s \(restart 1 of 5", after=seen)
        restarted = int(up.wait_line(r"worker restarted \(pid (\d+)\)", after=seen)[1])
        assert restarted != worker and up.child("worker") == restarted
        _wait_for_new_group(up, headers, {first})
        job = _render(up, headers)
        assert job["status"] == "succeeded", job

        seen = len(up.lines)
        celery = up.child("celery")
        pool = [int(p) for p in
                Path(f"/proc/{celery}/task/{celery}/children").read_text().split()]
        assert pool  # the prefork pool
        os.kill(celery, signal.SIGKILL)
        up.wait_line(r"celery exited with code -9 \(killed by SIGKILL\)", after=seen)
        restarted = int(up.wait_line(r"celery restarted \(pid (\d+)\)", after=seen)[1])
        assert up.child("celery") == restarted
        deadline = time.monotonic() + 30
        while any(map(_alive, pool)):  # the old pool went with its parent
            assert time.monotonic() < deadline, pool
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while up.log("celery").count(" ready.") < 2:  # the new Celery's banner, appended
            assert time.monotonic() < deadline, up.log("celery")
            time.sleep(0.2)
        probe.stop()
        assert probe.asked > 20 and not probe.failures, probe.failures

        # What kiln up prints is its own; the children's output is in their files.
        assert "GET /healthz" not in up.output and " rank=0 " not in up.output
        assert "celery@" not in up.output
        assert "logs      var/logs/ (redis.log, api.log, worker.log, celery.log" in up.output
        assert '"GET /healthz HTTP/1.1" 200' in up.log("api")
        assert up.log("worker").count("----- kiln up") >= 3  # two starts and an exit
        assert " rank=0 " in up.log("worker")
        assert "Ready to accept connections" in up.log("redis")
        children = [up.child(name) for name in ("redis", "api", "worker", "celery")]
    finally:
        code = up.stop()
    assert code == 0, up.output
    assert up.lines[-1] == "stopping ..."
    assert not any(_alive(pid) for pid in children)


@pytest.mark.slow
@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
def test_a_killed_api_and_private_redis_come_back_on_the_same_address(tmp_path: Path) -> None:
    up = Up(tmp_path, "--dp", "1", "--no-celery")
    try:
        headers = up.wait_up()
        redis_url = up.wait_line(r"redis     private server at (\S+)")[1]
        seen = len(up.lines)
        os.kill(up.child("api"), signal.SIGKILL)
        up.wait_line(r"api exited with code -9 \(killed by SIGKILL\)", after=seen)
        up.wait_line(r"api restarted \(pid \d+\)", after=seen)
        deadline = time.monotonic() + 60
        while not answers(f"{up.base}/healthz"):
            assert time.monotonic() < deadline, up.output
            time.sleep(0.2)
        assert httpx.get(f"{up.base}/v1/workers", headers=headers, timeout=30).status_code == 200

        seen = len(up.lines)
        os.kill(up.child("redis"), signal.SIGKILL)
        up.wait_line(r"redis exited with code -9 \(killed by SIGKILL\)", after=seen)
        up.wait_line(r"redis restarted \(pid \d+\)", after=seen)
        deadline = time.monotonic() + 30
        while True:  # the same address: every child keeps the REDIS_URL it was given
            try:
                with Redis.from_url(redis_url, socket_timeout=1) as client:
                    if client.ping():
                        break
            except RedisError:  # not up yet
                pass
            assert time.monotonic() < deadline, up.output
            time.sleep(0.2)
        while not answers(f"{up.base}/readyz"):  # the API reaches the new Redis
            assert time.monotonic() < deadline + 30, up.output
            time.sleep(0.2)
        assert up.log("api").count("----- kiln up") >= 3
    finally:
        code = up.stop()
    assert code == 0, up.output


@pytest.mark.chaos  # slow: `make chaos` runs it, `make test` does not
@pytest.mark.slow
def test_a_worker_that_fails_at_every_start_stops_kiln_up_with_a_plain_message(
        tmp_path: Path) -> None:
    # A model that is not there: the worker group exits at every start.
    up = Up(tmp_path, "--dp", "1", "--no-celery", "--model", "no-such-model")
    try:
        up.wait_up()
        # 1 + 2 + 4 + 8 + 16 s of delays, and six starts of the worker.
        code = up.proc.wait(timeout=240)
    finally:
        up.stop()
    up.reader.join(timeout=10)
    out = up.output
    assert code == 1, out
    for n, delay in enumerate((1, 2, 4, 8, 16), start=1):
        assert re.search(rf"worker exited with code 1 after .*; restarting in {delay} s "
                         rf"\(restart {n} of 5 allowed within 5 min; log: var/logs/worker.log\)",
                         out), out
    assert re.search(r"worker exited with code 1 after .* and has been restarted 5 times "
                     r"within 5 min: giving up, stopping everything\.\n"
                     r"The end of var/logs/worker\.log:\n", out), out
    tail = out.split("The end of var/logs/worker.log:\n")[1].splitlines()
    assert tail[-2].startswith("    ValueError: --model must be") and "no-such-model" in tail[-2]
    assert "Usage:" not in out and "Traceback" not in out.split("The end of")[0]
    assert out.endswith("stopping ...")
    assert not answers(f"{up.base}/healthz")  # the API stopped with it
    assert up.log("worker").count("----- kiln up") == 12  # six starts, six exits
