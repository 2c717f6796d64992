"""Large batch bodies over real HTTP (uvicorn in a thread): parsing and checking one runs off the
event loop, so other requests are answered meanwhile, and a body over the limit is refused while
it streams, before the client has sent the rest."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from servers import Server

from api.app import create_app

pytestmark = pytest.mark.parametrize("db", ["sqlite"], indirect=True)

LINE = {"prompt": "a red circle moving slowly from the left edge to the right " * 3,
        "width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 4, "seed": 7}


def _serve(api: Any, **settings: Any) -> Server:
    app = create_app(api.settings.model_copy(update=settings), engine=api.db.engine,
                     redis=api.redis, store=api.store)
    return Server(app, ws="none", http="h11")


def test_healthz_answers_at_once_while_a_15_mib_jsonl_batch_is_parsed_and_refused(api) -> None:  # noqa: ANN001
    # A million short lines, the last of them not a job: all are parsed before the batch is
    # refused, the most parsing a refused batch can cost (seconds).
    line = json.dumps({"prompt": "p"})
    num_lines = 15 * 2**20 // (len(line) + 1)
    body = "\n".join([line] * (num_lines - 1) + ["1"]).encode()
    assert len(body) > 14 * 2**20
    before = api.snapshot()
    outcome: dict[str, Any] = {}
    with _serve(api, max_queued_jobs_per_user=2 * num_lines) as url:
        def submit() -> None:
            started = time.monotonic()
            outcome["response"] = httpx.post(
                f"{url}/v1/batches", content=body, timeout=300,
                headers={**api.auth("alice"), "Content-Type": "application/x-ndjson"})
            outcome["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=submit)
        latencies = []
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/healthz").status_code == 200  # connected before the batch
            thread.start()
            while thread.is_alive():
                started = time.monotonic()
                assert client.get("/healthz").json() == {"status": "ok"}
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)
        thread.join()
    r = outcome["response"]
    assert r.status_code == 422, r.text[:300]
    assert r.json()["errors"][0]["field"] == f"jobs.{num_lines - 1}"
    # The batch kept the server busy for a while, and /healthz was answered all along.
    assert len(latencies) >= 5, (outcome["seconds"], latencies)
    # A 2-core machine under load pauses any thread now and then (the collector walking a million
    # fresh objects, the scheduler): what is checked is that no wait comes near the whole parse,
    # which is what a blocked event loop gives (the wait was the batch's full 6.4 s before).
    assert max(latencies) < outcome["seconds"] / 3, (outcome["seconds"], sorted(latencies)[-5:])
    assert api.snapshot() == before


def test_a_streamed_batch_over_the_limit_is_refused_before_the_rest_is_sent(api) -> None:  # noqa: ANN001
    limit = 2**20
    chunk = ((json.dumps(LINE) + "\n") * 200).encode()
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    offered = 64 * 2**20
    before = api.snapshot()
    with _serve(api, max_batch_body_bytes=limit) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                f"POST /v1/batches HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
                f"{api.auth('alice')['Authorization']}\r\nContent-Type: application/x-ndjson\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode())
            sent = 0
            # Send without Content-Length until the server answers (or all 64 MiB are gone).
            while sent < offered and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(chunk)
            answer = _read_response(sock)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), answer[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["detail"] == (
        f"request body is larger than the {limit} bytes allowed")
    # Cut off near the limit: what was sent beyond it sat in socket buffers, never parsed.
    assert sent < offered // 4, sent
    assert api.snapshot() == before


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body
