"""``GET /v1/events`` over real HTTP (uvicorn in a thread): a job's state changes in order, only
to keys that may see them, resumable with Last-Event-ID; a 503 while the database is out; the
stream ends when its client goes, and when its key is revoked."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from servers import Server

from api.app import create_app
from storage import feed, lifecycle
from storage.db import make_engine
from storage.outputs import LocalStore, thumbnail_key, video_key
from storage.users import revoke_api_key
from storage.workers import GroupReport, report_group

JOB = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4}


@dataclass
class Live:
    url: str
    app: Any
    db: Any
    store: LocalStore
    keys: dict[str, str]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def submit(self, who: str = "alice") -> str:
        r = httpx.post(f"{self.url}/v1/jobs", json=JOB, headers=self.auth(who))
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


@pytest.fixture
def live(api) -> Iterator[Live]:  # noqa: ANN001
    """The `api` fixture's database, Redis, store and keys, served by uvicorn; streams poll
    every 0.1 s and send a keep-alive every 0.3 s."""
    settings = api.settings.model_copy(update={"events_poll_seconds": 0.1,
                                               "events_heartbeat_seconds": 0.3})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    with Server(app) as url:
        yield Live(url, app, api.db, api.store, api.keys)


class Reader:
    """One open stream, read in the test's thread: the heartbeat (0.3 s here) keeps lines
    coming, so every wait checks its deadline."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.iter_lines()
        self.messages: list[dict[str, Any]] = []  # {"id": ..., "data": ...}, in arrival order
        self.comments: list[str] = []
        self._id: str | None = None
        self._data: list[str] = []

    def _read_one(self) -> None:
        line = next(self.lines)
        if line.startswith(":"):
            self.comments.append(line[1:].strip())
        elif line.startswith("id:"):
            self._id = line[3:].strip()
        elif line.startswith("data:"):
            self._data.append(line[5:].strip())
        elif not line and self._data:
            self.messages.append({"id": self._id, "data": json.loads("\n".join(self._data))})
            self._data = []

    def until(self, done: Callable[[Reader], bool], timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, self.messages
            self._read_one()

    def jobs(self, job_id: str) -> list[dict[str, Any]]:
        return [m for m in self.messages
                if m["data"]["type"] == "job" and m["data"]["job_id"] == job_id]

    def wait_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.until(lambda _: time.monotonic() >= end, timeout=seconds + 5)


@contextlib.contextmanager
def events(live: Live, *, headers: dict[str, str] | None = None,
           params: dict[str, str] | None = None) -> Iterator[Reader]:
    with httpx.Client(base_url=live.url, timeout=10) as client, \
            client.stream("GET", "/v1/events", headers=headers, params=params) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        yield Reader(r)


def _run(live: Live, job_id: str) -> None:
    """The job through the worker's storage calls: claimed, two steps, succeeded."""
    with live.db.session() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id="g1", rank=0, lease_seconds=60)
        assert claim is not None
        for step in (1, 2):
            assert lifecycle.heartbeat(s, job_id, claim.attempt_token, step=step,
                                       lease_seconds=60)
            time.sleep(0.4)  # the stream polls every 0.1 s here: each step is seen
        live.store.put_bytes(video_key(job_id), b"mp4")
        assert lifecycle.finish_succeeded(s, job_id, claim.attempt_token,
                                          video_key=video_key(job_id),
                                          thumbnail_key=thumbnail_key(job_id))


def test_a_jobs_changes_arrive_in_order_to_its_owner_only_and_resume_after_the_last_seen(
        live: Live) -> None:
    with events(live, headers=live.auth("alice")) as alice, \
            events(live, headers=live.auth("bob")) as bob, \
            events(live, headers=live.auth("root")) as root:
        job = live.submit("alice")
        _run(live, job)
        alice.until(lambda r: any(m["data"]["kind"] == "succeeded" for m in r.jobs(job)))
        seen = alice.jobs(job)
        assert [m["data"]["kind"] for m in seen] == ["created", "claimed", "succeeded"]
        assert [m["data"]["status"] for m in seen] == ["queued", "running", "succeeded"]
        assert seen[1]["data"]["detail"] == {"worker_group_id": "g1", "rank": 0}
        ids = [int(m["id"]) for m in seen]
        assert ids == sorted(ids) and len(set(ids)) == 3
        steps = [m["data"]["step"] for m in alice.messages
                 if m["data"]["type"] == "progress" and m["data"]["job_id"] == job]
        assert steps[-2:] == [1, 2], alice.messages
        root.until(lambda r: len(r.jobs(job)) == 3)  # an admin sees everyone's
        bob.wait_for(0.5)
        assert not [m for m in bob.messages if m["data"].get("job_id") == job]
        assert bob.comments and "keep-alive" in bob.comments[0]

    # Reconnecting with the id of the last message seen skips what was seen.
    claimed_id = seen[1]["id"]
    later = live.submit("alice")
    with events(live, headers={**live.auth("alice"), "Last-Event-ID": claimed_id}) as again:
        again.until(lambda r: bool(r.jobs(later)))
        assert [m["data"]["kind"] for m in again.jobs(job)] == ["succeeded"]
        assert [m["data"]["kind"] for m in again.jobs(later)] == ["created"]
    # A first connection (which cannot send the header) may say the same with ?after=.
    with events(live, headers=live.auth("alice"), params={"after": seen[2]["id"]}) as third:
        third.until(lambda r: bool(r.jobs(later)))
        assert third.jobs(job) == []


def test_worker_groups_and_batches_are_streamed(live: Live) -> None:
    report = GroupReport(id="g1", name="group one", host="h", model="kiln-tiny",
                         mode="allgather", platform="cpu", dp_size=1, world_size=1)
    with live.db.session() as s:
        report_group(s, report)
    batch = httpx.post(f"{live.url}/v1/batches", headers=live.auth("alice"),
                       json={"defaults": {k: v for k, v in JOB.items() if k != "prompt"},
                             "jobs": [{"prompt": "a"}, {"prompt": "b"}]}).json()
    with events(live, headers=live.auth("alice")) as alice:
        alice.until(lambda r: any(m["data"]["type"] == "worker_group" for m in r.messages))
        with live.db.session() as s:
            report.state, report.reason = "degraded", "Redis is unreachable"
            report_group(s, report)
            jobs = httpx.get(f"{live.url}/v1/jobs", params={"batch_id": batch["id"]},
                             headers=live.auth("alice")).json()["data"]
            claim = lifecycle.claim_job(s, jobs[0]["id"], worker_group_id="g1",
                                        lease_seconds=60)
            assert claim is not None
            lifecycle.fail_job(s, jobs[0]["id"], claim.attempt_token, error="out of memory")
        alice.until(lambda r: any(m["data"]["type"] == "batch"
                                  and m["data"]["counts"]["failed"] == 1 for m in r.messages))
        alice.until(lambda r: any(m["data"].get("state") == "degraded" for m in r.messages))
    groups = [m["data"] for m in alice.messages if m["data"]["type"] == "worker_group"]
    assert [(g["state"], g["reason"]) for g in groups] == [
        ("ready", None), ("degraded", "Redis is unreachable")]
    [failed] = [m["data"] for m in alice.messages if m["data"]["type"] == "batch"
                and m["data"]["counts"]["failed"] == 1]
    assert failed["id"] == batch["id"] and failed["progress"]["finished"] == 1


def test_the_stream_ends_when_its_client_goes(live: Live) -> None:
    streams = live.app.state.event_streams
    with events(live, headers=live.auth("alice")) as r:
        r.until(lambda r: bool(r.comments))
        assert streams.open == 1
    deadline = time.monotonic() + 10
    while streams.open:
        assert time.monotonic() < deadline, "the stream outlived its client"
        time.sleep(0.05)


def test_keys_are_checked_and_taken_from_the_header_only(live: Live) -> None:
    with httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.get("/v1/events").status_code == 401
        assert client.get("/v1/events", headers={"Authorization": "Bearer kiln_nope"}
                          ).status_code == 401
        r = client.get("/v1/events", headers={**live.auth("alice"), "Last-Event-ID": "x"})
        assert r.status_code == 422
        # A key in the URL is refused, even a good one beside a good header: a URL is logged.
        for headers in ({}, live.auth("alice")):
            r = client.get("/v1/events", params={"key": live.keys["alice"]}, headers=headers)
            assert r.status_code == 400, r.text
            assert "Authorization: Bearer" in r.json()["error"]["message"], r.text
        assert client.get("/v1/jobs", params={"key": live.keys["alice"]}).status_code == 401


def test_a_revoked_keys_open_stream_ends_within_the_key_cache_ttl(api) -> None:  # noqa: ANN001
    ttl = 1.0
    settings = api.settings.model_copy(update={"events_poll_seconds": 0.1,
                                               "events_heartbeat_seconds": 0.3,
                                               "api_key_cache_seconds": ttl})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    with Server(app) as url:
        live = Live(url, app, api.db, api.store, api.keys)
        with events(live, headers=live.auth("alice")) as alice, \
                events(live, headers=live.auth("bob")) as bob:
            alice.wait_for(2 * ttl)  # several key checks pass while the key is good
            with api.session() as s:
                assert revoke_api_key(s, live.keys["alice"][5:17])
            revoked_at = time.monotonic()
            with pytest.raises(StopIteration):
                alice.until(lambda _: False, timeout=ttl + 2)
            ended_after = time.monotonic() - revoked_at
            assert alice.comments[-1].startswith("the API key was revoked"), alice.comments
            # Bob's stream, on a key still good, goes on.
            bob.wait_for(0.5)
        # Within the TTL, give or take the poll that notices it.
        assert ended_after <= ttl + 0.3, ended_after
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/v1/events", headers=live.auth("alice")).status_code == 401


def test_an_exhausted_connection_pool_is_a_503_not_a_stream(api) -> None:  # noqa: ANN001
    engine = make_engine(api.db.url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    app = create_app(api.settings, engine=engine, redis=api.redis, store=api.store)
    try:
        with TestClient(app) as http:
            assert http.get("/v1/summary", headers=api.auth("alice")).status_code == 200
            with engine.connect():  # the pool's only connection, held elsewhere
                r = http.get("/v1/events", headers=api.auth("alice"))
            assert r.status_code == 503 and r.headers["Retry-After"] == "5"
            assert r.json()["error"]["code"] == "database_unavailable"
    finally:
        engine.dispose()


def test_the_cursor_waits_for_ids_committed_late_then_gives_up_on_them() -> None:
    cursor = feed.EventCursor(10, grace_seconds=5)
    for i in (11, 13, 14):
        cursor.saw(i)
    assert (cursor.watermark, cursor.high, cursor.missing()) == (11, 14, [12])
    cursor.settle(100.0)
    cursor.settle(104.0)
    assert cursor.watermark == 11  # still waiting for 12
    cursor.saw(12)  # committed late: delivered, and the cursor moves past it
    assert (cursor.watermark, cursor.missing()) == (14, [])
    cursor.saw(16)
    cursor.settle(200.0)
    cursor.settle(205.0)  # 15 never came (a rolled-back insert)
    assert (cursor.watermark, cursor.missing()) == (16, [])
