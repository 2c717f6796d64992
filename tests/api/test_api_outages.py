"""The API under real outages: a private Redis killed, frozen and started again, and PostgreSQL
behind a proxy that refuses connections; an exhausted connection pool on both databases.

A request that needs the database while it is unreachable gets a 503 with Retry-After and the
usual JSON error body; Redis is only an index, so without it requests still succeed and the jobs
are indexed later. ``/healthz`` stays 200, ``/readyz`` names what is down, and the API recovers
by itself once the server is back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy.exc
from fastapi.testclient import TestClient
from faults import PrivateRedis, TcpProxy
from sqlalchemy import make_url

from api.app import create_app
from scheduler import queue_index
from storage.db import make_engine
from storage.users import create_api_key

JOB = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4}
BATCH = {"defaults": {k: v for k, v in JOB.items() if k != "prompt"},
         "jobs": [{"prompt": "a"}, {"prompt": "b"}]}
JSONL = "\n".join(json.dumps({**JOB, "prompt": p}) for p in ("c", "d"))

# (method, path, request kwargs). "{job}" and "{batch}" are made before the outage.
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/v1/jobs", {"json": JOB}),
    ("GET", "/v1/jobs", {}),
    ("GET", "/v1/jobs/{job}", {}),
    ("GET", "/v1/jobs/{job}/video", {}),
    ("POST", "/v1/jobs/{job}/cancel", {}),
    ("GET", "/v1/workers", {}),
    ("GET", "/v1/summary", {}),
    ("POST", "/v1/videos", {"data": {"prompt": "p", "size": "64x64", "seconds": "1"}}),
    ("POST", "/v1/videos", {"json": {"prompt": "p", "size": "64x64", "seconds": "1"}}),
    ("GET", "/v1/videos", {}),
    ("GET", "/v1/videos/{job}", {}),
    ("GET", "/v1/videos/{job}/content", {}),
    ("POST", "/v1/batches", {"json": BATCH}),
    ("POST", "/v1/batches", {"content": JSONL,
                             "headers": {"Content-Type": "application/x-ndjson"}}),
    ("GET", "/v1/batches", {}),
    ("GET", "/v1/batches/{batch}", {}),
    ("GET", "/v1/batches/{batch}/report", {}),
    ("POST", "/v1/batches/{batch}/cancel", {}),
    ("DELETE", "/v1/videos/{job}", {}),
]
# What each answers without Redis: the same as with it (the job is cancelled by then).
WITHOUT_REDIS = [201, 200, 200, 409, 200, 200, 200, 200, 200, 200, 200, 409, 201, 201, 200, 200,
                 200, 200, 200]


class Caller:
    """Sends `REQUESTS` with one user's key, filling in the ids made before the outage."""

    def __init__(self, client: TestClient, key: str, ids: dict[str, str]) -> None:
        self.client = client
        self.key = key
        self.ids = ids

    def __call__(self, method: str, path: str, kwargs: dict[str, Any], key: str | None = None):  # noqa: ANN204
        kwargs = dict(kwargs)
        headers = {"Authorization": f"Bearer {key or self.key}", **kwargs.pop("headers", {})}
        return self.client.request(method, path.format(**self.ids), headers=headers, **kwargs)


def _app(api: Any, **clients: Any) -> Any:
    """An app like the `api` fixture's with its own ``engine`` or ``redis``; room for the jobs
    these tests queue."""
    settings = api.settings.model_copy(update={"max_queued_jobs_per_user": 100})
    return create_app(settings, **{"engine": api.db.engine, "redis": api.redis,
                                   "store": api.store, **clients})


def _made_before(client: TestClient, key: str) -> dict[str, str]:
    auth = {"Authorization": f"Bearer {key}"}
    job = client.post("/v1/jobs", json=JOB, headers=auth)
    batch = client.post("/v1/batches", json=BATCH, headers=auth)
    assert (job.status_code, batch.status_code) == (201, 201), (job.text, batch.text)
    return {"job": job.json()["id"], "batch": batch.json()["id"]}


def _assert_unavailable(r: Any, dependency: str, what: str) -> None:
    assert r.status_code == 503, (what, r.status_code, r.text[:300])
    assert r.headers["Retry-After"] == "5", what
    body = r.json()
    assert body["error"]["type"] == "service_unavailable", what
    assert body["error"]["code"] == f"{dependency}_unavailable", what
    assert "unreachable" in body["detail"] and "retry in 5 s" in body["detail"], what


def _wait_until(check: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the API did not recover"
        time.sleep(0.1)


def _indexed(client: redis.Redis, prefix: str) -> set[str]:
    return {m.decode() for key in queue_index.ready_keys(prefix)
            for m in client.zrange(key, 0, -1)}


# ---------------------------------------------------------------------------------------------
# Redis


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    with PrivateRedis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def on_private_redis(api, private_redis: PrivateRedis) -> Iterator[tuple[TestClient, redis.Redis]]:  # noqa: ANN001
    """The test's app, on the test's database, with the private Redis as its queue index."""
    client = redis.Redis.from_url(private_redis.url, socket_timeout=1, socket_connect_timeout=1)
    with TestClient(_app(api, redis=client)) as http:
        yield http, client
    client.close()


def test_without_redis_every_request_succeeds_and_reconcile_indexes_the_jobs_later(
        api, private_redis: PrivateRedis, on_private_redis: tuple[TestClient, redis.Redis]  # noqa: ANN001
) -> None:
    http, client = on_private_redis
    prefix = api.settings.redis_prefix
    ids = _made_before(http, api.keys["alice"])
    assert _indexed(client, prefix) == {ids["job"], *_batch_jobs(http, api, ids["batch"])}
    call = Caller(http, api.keys["alice"], ids)

    private_redis.kill()
    made: list[str] = []
    for (method, path, kwargs), expected in zip(REQUESTS, WITHOUT_REDIS, strict=True):
        r = call(method, path, kwargs)
        assert r.status_code == expected, (method, path, r.status_code, r.text[:300])
        if method == "POST" and path in ("/v1/jobs", "/v1/videos"):
            made.append(r.json()["id"])
            if path == "/v1/jobs":  # counted in the database instead of the index
                assert isinstance(r.json()["queue_position"], int)
        elif method == "POST" and path == "/v1/batches":
            made += _batch_jobs(http, api, r.json()["id"])
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
    assert ready.json()["checks"] == {"database": "ok",
                                      "redis": "unreachable (ConnectionError)"}
    assert ready.json()["detail"] == "redis: unreachable (ConnectionError)"

    private_redis.start()  # the same port, empty: a lost Redis
    _wait_until(lambda: http.get("/readyz").status_code == 200)
    after = call("POST", "/v1/jobs", {"json": JOB})
    assert after.status_code == 201 and after.json()["queue_position"] is not None
    assert _indexed(client, prefix) == {after.json()["id"]}
    http.app.state.reconcile()  # what the API does every reconcile_interval_seconds
    assert _indexed(client, prefix) == {*made, after.json()["id"]}


def _batch_jobs(http: TestClient, api: Any, batch_id: str) -> list[str]:
    r = http.get(f"/v1/jobs?batch_id={batch_id}", headers=api.auth("alice"))
    return [j["id"] for j in r.json()["data"] if j["status"] == "queued"]


def test_a_frozen_redis_times_out_and_requests_still_succeed(
        api, private_redis: PrivateRedis, on_private_redis: tuple[TestClient, redis.Redis]  # noqa: ANN001
) -> None:
    http, _ = on_private_redis
    call = Caller(http, api.keys["alice"], _made_before(http, api.keys["alice"]))
    from_index = call("GET", "/v1/jobs/{job}", {}).json()["queue_position"]
    private_redis.pause()
    try:
        submitted = call("POST", "/v1/jobs", {"json": JOB})
        assert submitted.status_code == 201, submitted.text
        # The database's count stands in for the index, and agrees with it.
        assert call("GET", "/v1/jobs/{job}", {}).json()["queue_position"] == from_index
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["redis"] == "unreachable (TimeoutError)"
    finally:
        private_redis.resume()
    _wait_until(lambda: http.get("/readyz").status_code == 200)


# ---------------------------------------------------------------------------------------------
# The database


@pytest.fixture
def behind_proxy(api) -> Iterator[tuple[TestClient, TcpProxy]]:  # noqa: ANN001
    """The test's app reaching the test's PostgreSQL database through a proxy."""
    url = make_url(api.db.url)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        engine = make_engine(url.set(host="127.0.0.1", port=proxy.port)
                             .render_as_string(hide_password=False), pool_size=2, max_overflow=2)
        try:
            with TestClient(_app(api, engine=engine)) as http:
                yield http, proxy
        finally:
            engine.dispose()


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_while_the_database_refuses_connections_every_request_gets_a_503_then_it_recovers(
        api, behind_proxy: tuple[TestClient, TcpProxy]) -> None:  # noqa: ANN001
    http, proxy = behind_proxy
    ids = _made_before(http, api.keys["alice"])  # alice's key is in the API's cache from now on
    call = Caller(http, api.keys["alice"], ids)
    with api.session() as s:
        new_key = create_api_key(s, "carol").key  # never seen by the API
    before = api.snapshot()
    index_before = _indexed(api.redis, api.settings.redis_prefix)

    proxy.refuse()
    for method, path, kwargs in REQUESTS:
        _assert_unavailable(call(method, path, kwargs), "database", f"{method} {path}")
        _assert_unavailable(call(method, path, kwargs, key=new_key), "database",
                            f"{method} {path} with a key not in the cache")
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/dashboard").status_code == 200  # the page itself holds no data
    assert http.get("/metrics").status_code == 200  # without the database's figures
    ready = http.get("/readyz")
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
    assert ready.json()["checks"] == {"database": "unreachable (OperationalError)",
                                      "redis": "ok"}
    assert api.snapshot() == before
    assert _indexed(api.redis, api.settings.redis_prefix) == index_before

    proxy.accept()
    assert http.get("/readyz").status_code == 200
    assert call("GET", "/v1/jobs/{job}", {}).status_code == 200
    assert call("POST", "/v1/jobs", {"json": JOB}).status_code == 201
    assert call("GET", "/v1/summary", {}, key=new_key).status_code == 200


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_connections_cut_while_pooled_are_replaced_without_an_error(
        api, behind_proxy: tuple[TestClient, TcpProxy]) -> None:  # noqa: ANN001
    http, proxy = behind_proxy
    call = Caller(http, api.keys["alice"], _made_before(http, api.keys["alice"]))
    # A database restart between two requests: every pooled connection is dead, the server is
    # back before the next request.
    proxy.refuse()
    proxy.accept()
    for method, path, kwargs in REQUESTS[:3]:
        r = call(method, path, kwargs)
        assert r.status_code in (200, 201), (method, path, r.text[:300])


def test_an_exhausted_connection_pool_is_a_503(api) -> None:  # noqa: ANN001
    engine = make_engine(api.db.url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        with TestClient(_app(api, engine=engine)) as http:
            call = Caller(http, api.keys["alice"], _made_before(http, api.keys["alice"]))
            before = api.snapshot()
            with engine.connect():  # the pool's only connection, held elsewhere
                for method, path, kwargs in REQUESTS[:3]:
                    _assert_unavailable(call(method, path, kwargs), "database",
                                        f"{method} {path}")
            assert call("GET", "/v1/jobs/{job}", {}).status_code == 200
            assert api.snapshot() == before
    finally:
        engine.dispose()


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_errors_that_are_not_outages_are_a_json_500(api) -> None:  # noqa: ANN001
    app = _app(api)

    def broken() -> None:
        raise RuntimeError("a bug")

    def conflicting() -> None:  # a DBAPIError whose connection is fine: a bug, not weather
        raise sqlalchemy.exc.IntegrityError("INSERT ...", {}, Exception("duplicate key"))

    app.add_api_route("/broken", broken)
    app.add_api_route("/conflicting", conflicting)
    with TestClient(app, raise_server_exceptions=False) as http:
        for path in ("/broken", "/conflicting"):
            r = http.get(path)
            assert r.status_code == 500 and "Retry-After" not in r.headers, path
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["code"] == "internal_error"
            assert "a bug" not in r.text and "Traceback" not in r.text
