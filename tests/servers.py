"""Real servers on free local ports, in threads: the API under uvicorn, and a webhook receiver."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import uvicorn

from kiln.procs import free_port


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
