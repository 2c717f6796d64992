"""A client that disconnects while sending its body is a 400 and one INFO line, never a traceback:
for every route that reads a body (JSON, a batch's JSON or multipart upload) through the ASGI
app, and against a real uvicorn server whose client hangs up mid-body."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import pytest
from servers import Server

from api.app import create_app

if TYPE_CHECKING:
    from conftest import Api

LINE = "the client disconnected before its whole body arrived"


class Records(logging.Handler):
    """Every record of the loggers it is attached to, uvicorn's included (they do not
    propagate to the root logger, where pytest's own capture listens)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error")]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        for logger in self.loggers:
            logger.addHandler(self)
        self.levels = [logger.level for logger in self.loggers]
        logging.getLogger("api.errors").setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)
        logging.getLogger("api.errors").setLevel(logging.NOTSET)

    def about_the_disconnect(self) -> list[logging.LogRecord]:
        return [r for r in self.records if LINE in r.getMessage()]

    def tracebacks(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


JSON_START = b'{"prompt": "a'
MULTIPART_START = (b'--kiln\r\nContent-Disposition: form-data; name="file"; filename="n.jsonl"'
                   b'\r\nContent-Type: application/jsonl\r\n\r\n{"prompt": "a')


def _hang_up(app: Any, path: str, content_type: bytes, start: bytes, key: str) -> list[int]:
    """POSTs a body of which only ``start`` arrives before ``http.disconnect``; the statuses
    the app answered."""
    messages = [{"type": "http.request", "body": start, "more_body": True}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"kiln"), (b"content-type", content_type),
                         (b"content-length", b"1000"),
                         (b"authorization", f"Bearer {key}".encode())]}
    asyncio.run(app(scope, receive, send))
    return [m["status"] for m in sent if m["type"] == "http.response.start"]


@pytest.mark.parametrize(("path", "content_type", "start"), [
    ("/v1/jobs", b"application/json", JSON_START),
    ("/v1/batches", b"application/json", JSON_START),
    ("/v1/batches", b"multipart/form-data; boundary=kiln", MULTIPART_START),
    ("/v1/videos", b"application/json", JSON_START),
], ids=["job", "batch-json", "batch-upload", "video"])
def test_a_body_cut_off_by_a_disconnect_is_a_400_and_one_quiet_line(
        api: Api, path: str, content_type: bytes, start: bytes) -> None:
    before = api.snapshot()
    with Records() as logs:
        statuses = _hang_up(api.app, path, content_type, start, api.keys["alice"])
    assert statuses == [400]
    [line] = logs.about_the_disconnect()
    assert (line.levelno, line.name, line.getMessage()) == (
        logging.INFO, "api.errors", f"POST {path}: 400, {LINE}")
    assert logs.tracebacks() == []
    assert api.snapshot() == before


def test_a_client_hanging_up_mid_body_on_a_real_server_leaves_no_traceback(api: Api) -> None:
    app = create_app(api.settings, engine=api.db.engine, redis=api.redis,  # type: ignore[attr-defined]
                     store=api.store)
    with Records() as logs, Server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: kiln\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                           b"Authorization: Bearer " + api.keys["alice"].encode() + b"\r\n\r\n"
                           b'{"prompt": "a')
            time.sleep(0.2)  # the app is now waiting for the rest of the body
        deadline = time.monotonic() + 10
        while not logs.about_the_disconnect() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # a traceback, were one logged, would follow the line at once
    [line] = logs.about_the_disconnect()
    assert line.levelno == logging.INFO
    assert logs.tracebacks() == [], [r.getMessage() for r in logs.tracebacks()]
