"""Real outages for fault tests: a private Redis server to kill, pause and start again, and a TCP
proxy in front of a server (PostgreSQL) that can be switched to refusing connections.

Neither touches the shared servers: the code under test is pointed at the private Redis or at
the proxy's port, and the outage happens there.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from common.procs import free_port


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free 127.0.0.1 port, without persistence (a
    restart comes back empty, as a lost Redis does). `kill` ends it at once, `start` brings it
    back on the same port, `pause` and `resume` freeze and thaw it (clients then time out)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("no redis-server on PATH")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> None:
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        with redis.Redis.from_url(self.url, socket_timeout=1) as client:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the private Redis on {self.port} did not start"
                                           ) from None
                    time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: connections drop, new ones are refused."""
        assert self.proc is not None, "not running"
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but never answered."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.resume()  # a stopped process does not act on SIGKILL until it runs again
            self.kill()


class TcpProxy:
    """Forwards 127.0.0.1:``port`` (a free port) to ``target``. `refuse` closes the listening
    socket and cuts every forwarded connection, so clients see what a server that went down
    shows them: dropped connections, then "connection refused". `accept` listens again on the
    same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def accepting(self) -> bool:
        return self._listener is not None

    def accept(self) -> None:
        assert self._listener is None, "already accepting"
        # create_server sets SO_REUSEADDR: the port is free again at once after `refuse`.
        listener = socket.create_server(("127.0.0.1", self.port))
        listener.settimeout(0.05)
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, args=(listener,), daemon=True)
        self._thread.start()

    def refuse(self) -> None:
        listener, self._listener = self._listener, None
        assert listener is not None, "already refusing"
        listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            doomed, self._open = self._open, set()
        for sock in doomed:
            _close(sock)

    def _serve(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by refuse()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.difference_update((src, dst))
            _close(src)
            _close(dst)

    def __enter__(self) -> TcpProxy:
        self.accept()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._listener is not None:
            self.refuse()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
