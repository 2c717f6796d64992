"""Native /v1/jobs routes, workers, health and metrics, on SQLite and PostgreSQL with real Redis."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from api.jobs import QueueRoom
from migrations import current_heads
from scheduler import queue_index
from storage import lifecycle
from storage.workers import GroupReport, report_group


def _submit(api, who: str = "alice", **body: object):  # noqa: ANN001, ANN202
    payload = {"prompt": "a red circle moving left", "width": 64, "height": 64,
               "num_frames": 9, "num_inference_steps": 4, **body}
    return api.client.post("/v1/jobs", json=payload, headers=api.auth(who))


def test_submit_stores_a_queued_job_then_indexes_it_in_redis(api) -> None:
    r = _submit(api, seed=7, metadata={"run": "n1"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["queue_position"] == 0
    assert (job["width"], job["num_frames"], job["seed"], job["model"]) == (64, 9, 7, "kiln-tiny")
    assert (job["progress"], job["step"], job["total_steps"]) == (0.0, 0, 4)
    assert job["class"] == "interactive" and job["priority"] == 5
    assert job["fps"] == 8 and job["metadata"] == {"run": "n1"}  # kiln-tiny's own fps
    key = queue_index.ready_key(api.settings.redis_prefix, "interactive", 5)
    assert api.redis.zscore(key, job["id"]) is not None
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth("alice")).json()
    assert got["id"] == job["id"] and got["status"] == "queued"


def test_queue_position_counts_jobs_ahead(api) -> None:
    first = _submit(api).json()
    second = _submit(api).json()
    urgent = _submit(api, priority=9).json()
    positions = [api.client.get(f"/v1/jobs/{j['id']}", headers=api.auth("alice"))
                 .json()["queue_position"] for j in (first, second, urgent)]
    assert positions == [1, 2, 0]


def test_same_idempotency_key_and_body_returns_the_same_job(api) -> None:
    headers = {**api.auth("alice"), "Idempotency-Key": "order-42"}
    body = {"prompt": "a cat", "width": 64, "height": 64}
    first = api.client.post("/v1/jobs", json=body, headers=headers)
    again = api.client.post("/v1/jobs", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    other = api.client.post("/v1/jobs", json={**body, "prompt": "a dog"}, headers=headers)
    assert other.status_code == 409
    assert "Idempotency-Key" in other.json()["detail"]
    listed = api.client.get("/v1/jobs", headers=api.auth("alice")).json()
    assert len(listed["data"]) == 1


def test_users_see_only_their_jobs_and_admins_see_all(api) -> None:
    job_id = _submit(api, "alice").json()["id"]
    for method, path in [("get", f"/v1/jobs/{job_id}"), ("post", f"/v1/jobs/{job_id}/cancel"),
                         ("get", f"/v1/jobs/{job_id}/video"),
                         ("get", f"/v1/jobs/{job_id}/thumbnail"),
                         ("get", f"/v1/videos/{job_id}"), ("delete", f"/v1/videos/{job_id}"),
                         ("get", f"/v1/videos/{job_id}/content")]:
        r = api.client.request(method, path, headers=api.auth("bob"))
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["detail"] == "job not found"
    assert api.client.get("/v1/jobs", headers=api.auth("bob")).json()["data"] == []
    as_admin = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("root")).json()
    assert as_admin["owner"] == "alice" and as_admin["status"] == "queued"
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=api.auth("root"))
            .json()["data"]] == [job_id]


def test_cancel_queued_is_immediate_and_leaves_the_ready_index(api) -> None:
    job = _submit(api).json()
    r = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.auth("alice"))
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert r.json()["error"]["code"] == "cancelled"
    key = queue_index.ready_key(api.settings.redis_prefix, "interactive", 5)
    assert api.redis.zscore(key, job["id"]) is None
    again = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.auth("alice"))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_cancel_running_sets_the_flag_the_rank_reads_at_its_next_step(api) -> None:
    job_id = _submit(api).json()["id"]
    with api.session() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id="g", rank=0, lease_seconds=60)
        assert claim is not None
        lifecycle.heartbeat(s, job_id, claim.attempt_token, step=2, lease_seconds=60)
    running = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("alice")).json()
    assert (running["status"], running["progress"], running["step"]) == ("running", 0.5, 2)
    assert running["queue_position"] is None and running["attempts"] == 1
    r = api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.auth("alice"))
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["cancel_requested"]) == ("running", True)
    with api.session() as s:
        beat = lifecycle.heartbeat(s, job_id, claim.attempt_token, step=3, lease_seconds=60)
        assert beat is not None and beat.cancel_requested
        assert lifecycle.finish_cancelled(s, job_id, claim.attempt_token)
    done = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("alice")).json()
    assert done["status"] == "cancelled"


def test_finished_job_downloads_video_and_thumbnail_storage_path_not_a_render(api) -> None:
    job_id = _submit(api).json()["id"]
    early = api.client.get(f"/v1/jobs/{job_id}/video", headers=api.auth("alice"))
    assert early.status_code == 409 and "queued" in early.json()["detail"]
    api.finish(job_id, video=b"\x00\x00\x00 ftyp fake mp4", thumb=b"\x89PNG fake")
    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("alice")).json()
    assert job["status"] == "succeeded" and job["progress"] == 1.0
    assert job["video_url"] == f"/v1/jobs/{job_id}/video"
    video = api.client.get(job["video_url"], headers=api.auth("alice"))
    assert video.status_code == 200 and video.content == b"\x00\x00\x00 ftyp fake mp4"
    assert video.headers["content-type"] == "video/mp4"
    thumb = api.client.get(job["thumbnail_url"], headers=api.auth("alice"))
    assert thumb.content == b"\x89PNG fake" and thumb.headers["content-type"] == "image/png"
    assert api.client.post(f"/v1/jobs/{job_id}/cancel",
                           headers=api.auth("alice")).status_code == 409


def test_list_filters_by_status_and_pages_with_a_cursor(api) -> None:
    ids = [_submit(api).json()["id"] for _ in range(5)]
    api.client.post(f"/v1/jobs/{ids[0]}/cancel", headers=api.auth("alice"))
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/jobs", params=params, headers=api.auth("alice")).json()
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        assert page["has_more"] == (cursor is not None)
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    queued = api.client.get("/v1/jobs", params={"status": "queued"},
                            headers=api.auth("alice")).json()["data"]
    assert sorted(j["id"] for j in queued) == sorted(ids[1:])
    both = api.client.get("/v1/jobs", params=[("status", "queued"), ("status", "cancelled")],
                          headers=api.auth("alice")).json()["data"]
    assert len(both) == 5


def test_queued_job_limit_answers_429_with_retry_after(api) -> None:
    for _ in range(api.settings.max_queued_jobs_per_user):
        assert _submit(api).status_code == 201
    r = _submit(api)
    assert r.status_code == 429
    assert r.headers["Retry-After"] == str(api.settings.queue_full_retry_after_seconds)
    assert "queued jobs" in r.json()["detail"]
    assert _submit(api, "bob").status_code == 201  # the limit is per user


def test_a_big_limit_is_counted_now_and_then_and_still_holds(api) -> None:
    # With room to spare a process skips most counts; near the limit every submit counts.
    limit = 40
    settings = api.settings.model_copy(update={"max_queued_jobs_per_user": limit})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    counted: list[int] = []
    room = app.state.queue_room
    real = room.counted
    room.counted = lambda user_id, queued, lim: (counted.append(queued), real(user_id, queued, lim))
    with TestClient(app) as client:
        def submit() -> int:
            return client.post("/v1/jobs", json={"prompt": "p"},
                               headers=api.auth("alice")).status_code

        assert [submit() for _ in range(limit + 1)] == [201] * limit + [429]
    assert counted[0] == 0 and len(counted) < limit  # some submits skipped the count
    assert counted[-3:] == [37, 38, 39]  # and the last ones before the limit did not


def test_queue_room_counts_again_after_a_while() -> None:
    room = QueueRoom(recount_seconds=0.05)
    assert room.must_count(1)
    room.counted(1, queued_before=0, limit=1000)  # room for ~250 skips
    assert not room.must_count(1) and not room.must_count(1)
    assert room.must_count(2)  # another user
    time.sleep(0.06)
    assert room.must_count(1)
    room.counted(1, queued_before=996, limit=1000)  # 3 left: none skipped
    assert room.must_count(1)


def test_ready_index_is_rebuilt_from_the_database_after_redis_loses_it(api) -> None:
    ids = {_submit(api).json()["id"] for _ in range(3)}
    prefix = api.settings.redis_prefix
    api.redis.delete(*api.redis.scan_iter(match=f"{prefix}*"))
    assert list(api.redis.scan_iter(match=f"{prefix}*")) == []
    api.app.state.reconcile()  # what startup and the periodic task run
    key = queue_index.ready_key(prefix, "interactive", 5)
    assert {m.decode() for m in api.redis.zrange(key, 0, -1)} == ids


def test_workers_lists_groups_ranks_memory_and_only_visible_jobs(api) -> None:
    alice_job = _submit(api, "alice").json()["id"]
    bob_job = _submit(api, "bob").json()["id"]
    with api.session() as s:
        for rank, job_id in enumerate((alice_job, bob_job)):
            assert lifecycle.claim_job(s, job_id, worker_group_id="node1-123", rank=rank,
                                       lease_seconds=60)
        report_group(s, GroupReport(
            id="node1-123", name="node1", host="node1", model="kiln-tiny", mode="allgather",
            platform="cpu", dp_size=2, world_size=2, goal="throughput",
            ranks=[{"rank": 0, "device": "cpu", "device_mem_used_bytes": 100,
                    "device_mem_total_bytes": 1000, "host_mem_bytes": 50, "job_id": alice_job},
                   {"rank": 1, "device": "cpu", "device_mem_used_bytes": 200,
                    "device_mem_total_bytes": 1000, "host_mem_bytes": 60, "job_id": bob_job}]))
    groups = api.client.get("/v1/workers", headers=api.auth("alice")).json()["data"]
    assert len(groups) == 1
    g = groups[0]
    assert (g["dp_size"], g["mode"], g["stale"], g["num_running"]) == (2, "allgather", False, 2)
    assert g["goal"] == "throughput"
    assert g["current_jobs"] == [alice_job]
    assert [r["job_id"] for r in g["ranks"]] == [alice_job, None]
    assert [r["device_mem_used_bytes"] for r in g["ranks"]] == [100, 200]
    as_admin = api.client.get("/v1/workers", headers=api.auth("root")).json()["data"][0]
    assert sorted(as_admin["current_jobs"]) == sorted([alice_job, bob_job])
    metrics = api.client.get("/metrics").text
    assert 'kiln_device_memory_used_bytes{group="node1-123",rank="1"} 200.0' in metrics


def test_health_readiness_metrics_and_openapi(api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"status": "ready"}
    _submit(api, priority=7)
    done = _submit(api).json()["id"]
    api.finish(done)
    text = api.client.get("/metrics").text
    assert 'kiln_queue_depth{class="interactive",priority="7"} 1.0' in text
    assert 'kiln_jobs{state="succeeded"} 1.0' in text
    assert "kiln_render_seconds_count 1.0" in text
    assert "kiln_videos_last_hour 1.0" in text
    assert "kiln_host_memory_total_bytes" in text
    paths = api.client.get("/openapi.json").json()["paths"]
    for path in ["/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/videos",
                 "/v1/videos/{video_id}/content", "/v1/workers", "/metrics", "/readyz"]:
        assert path in paths


def test_readyz_reports_an_unmigrated_database(api) -> None:
    with api.db.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("UPDATE alembic_version SET version_num = 'old'"))
    try:
        r = api.client.get("/readyz")
        assert r.status_code == 503 and "kiln db upgrade" in r.json()["detail"]
    finally:
        with api.db.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(text("UPDATE alembic_version SET version_num = :v"),
                         {"v": current_heads()[0]})


def test_deadline_and_not_before_are_stored_and_bounded(api) -> None:
    soon = datetime.now(UTC) + timedelta(hours=1)
    r = _submit(api, not_before=soon.isoformat(), deadline=(soon + timedelta(hours=1))
                .isoformat(), **{"class": "batch"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["class"] == "batch"
    assert datetime.fromisoformat(job["not_before"]) == soon
    key = queue_index.ready_key(api.settings.redis_prefix, "batch", 5)
    assert api.redis.zscore(key, job["id"]) == soon.timestamp()


def test_admins_filter_by_owner_and_users_cannot(api) -> None:
    alice_job = _submit(api, "alice").json()["id"]
    _submit(api, "bob")
    page = api.client.get("/v1/jobs", params={"owner": "alice"}, headers=api.auth("root"))
    assert [j["id"] for j in page.json()["data"]] == [alice_job]
    nobody = api.client.get("/v1/jobs", params={"owner": "nobody"}, headers=api.auth("root"))
    assert nobody.json()["data"] == []
    refused = api.client.get("/v1/jobs", params={"owner": "alice"}, headers=api.auth("bob"))
    assert refused.status_code == 403 and "admins" in refused.json()["detail"]


def test_revoked_keys_stop_working_once_the_key_cache_expires(api) -> None:
    from storage.users import revoke_api_key

    assert api.client.get("/v1/jobs", headers=api.auth("bob")).status_code == 200
    with api.session() as s:
        assert revoke_api_key(s, api.keys["bob"][5:17])
    api.app.state.key_cache.clear()  # what the TTL does with time
    r = api.client.get("/v1/jobs", headers=api.auth("bob"))
    assert r.status_code == 401 and r.json()["detail"] == "invalid or revoked API key"
    assert api.client.get("/v1/jobs", headers=api.auth("alice")).status_code == 200


def test_frame_count_off_the_vae_stride_is_a_422_naming_num_frames(api) -> None:  # noqa: ANN001
    r = _submit(api, num_frames=8)
    assert r.status_code == 422
    assert "num_frames" in r.text and "1 + a multiple of 4" in r.text
    assert _submit(api, num_frames=13).status_code == 201
