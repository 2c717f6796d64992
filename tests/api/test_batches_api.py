"""/v1/batches on SQLite and PostgreSQL with real Redis: JSON and JSONL submissions, whole-batch
refusal with line numbers, limits, idempotency, isolation, cancel, progress and the report."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from api.app import create_app
from scheduler import queue_index
from storage import lifecycle, queries
from storage.tables import Batch, Job

DEFAULTS = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9,
            "num_inference_steps": 4}


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _post(api, body: dict, who: str = "alice", **headers: str):  # noqa: ANN001, ANN202
    return api.client.post("/v1/batches", json=body, headers={**api.auth(who), **headers})


def _jsonl(*lines: object) -> bytes:
    return "\n".join(line if isinstance(line, str) else json.dumps(line)
                     for line in lines).encode()


def _jobs(api, batch_id: str) -> list[Job]:  # noqa: ANN001
    with api.session() as s:
        return list(s.scalars(select(Job).where(Job.batch_id == batch_id)
                              .order_by(Job.batch_index)))


def test_json_batch_queues_every_job_as_batch_class_with_defaults_and_window(api) -> None:
    opens = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    closes = opens + timedelta(hours=8)
    body = {"name": "night one", "defaults": DEFAULTS, "metadata": {"project": "p1"},
            "window": {"not_before": _iso(opens), "deadline": _iso(closes)},
            "jobs": [{"prompt": "a red circle"}, {"prompt": "a blue square", "seed": 3},
                     {"prompt": "a green line", "num_inference_steps": 2}]}
    r = _post(api, body)
    assert r.status_code == 201, r.text
    batch = r.json()
    assert (batch["status"], batch["name"], batch["metadata"]) == ("queued", "night one",
                                                                   {"project": "p1"})
    assert batch["counts"]["queued"] == 3 and sum(batch["counts"].values()) == 3
    assert batch["progress"] == {"finished": 0, "total": 3, "fraction": 0.0,
                                 "step_fraction": 0.0}
    assert batch["eta"] is None and batch["started_at"] is None
    assert datetime.fromisoformat(batch["not_before"]) == opens
    rows = _jobs(api, batch["id"])
    assert [j.prompt for j in rows] == ["a red circle", "a blue square", "a green line"]
    assert [j.batch_index for j in rows] == [1, 2, 3]
    assert {j.class_ for j in rows} == {"batch"}
    assert {(j.not_before, j.deadline) for j in rows} == {(opens, closes)}
    assert [j.num_inference_steps for j in rows] == [4, 4, 2] and rows[1].seed == 3
    assert {(j.width, j.num_frames) for j in rows} == {(64, 9)}
    key = queue_index.ready_key(api.settings.redis_prefix, "batch", 5)
    assert [api.redis.zscore(key, j.id) for j in rows] == [opens.timestamp()] * 3
    listed = api.client.get("/v1/jobs", params={"batch_id": batch["id"]},
                            headers=api.auth("alice")).json()["data"]
    assert sorted(j["id"] for j in listed) == sorted(j.id for j in rows)


def test_jsonl_upload_and_ndjson_body_give_the_same_jobs_with_their_line_numbers(api) -> None:
    lines = _jsonl({"prompt": "one"}, "", {"prompt": "three", "seed": 9})
    options = {"defaults": json.dumps(DEFAULTS), "name": "upload"}
    upload = api.client.post("/v1/batches", files={"file": ("night.jsonl", lines)},
                             data=options, headers=api.auth("alice"))
    assert upload.status_code == 201, upload.text
    body = api.client.post("/v1/batches", content=lines, params=options,
                           headers={**api.auth("alice"),
                                    "Content-Type": "application/x-ndjson"})
    assert body.status_code == 201, body.text
    for made in (upload.json(), body.json()):
        rows = _jobs(api, made["id"])
        assert [(j.batch_index, j.prompt, j.class_, j.width) for j in rows] == [
            (1, "one", "batch", 64), (3, "three", "batch", 64)]
        assert rows[1].seed == 9 and made["name"] == "upload"
        report = api.client.get(f"/v1/batches/{made['id']}/report",
                                headers=api.auth("alice")).json()
        assert [j["line"] for j in report["jobs"]] == [1, 3]


def test_a_bad_line_refuses_the_whole_batch_naming_line_and_field_and_stores_nothing(
        api) -> None:
    before = api.snapshot()
    lines = _jsonl({"prompt": "fine"}, {"prompt": "odd size", "width": 60}, "{not json",
                   {"prompt": "typo", "colour": "red"}, {"prompt": "fine too"})
    r = api.client.post("/v1/batches", files={"file": ("n.jsonl", lines)},
                        data={"defaults": json.dumps(DEFAULTS)}, headers=api.auth("alice"))
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert [(e["line"], e["field"]) for e in errors] == [(3, "line 3")]
    assert "not valid JSON" in errors[0]["message"]
    lines = _jsonl({"prompt": "fine"}, {"prompt": "odd size", "width": 60},
                   {"prompt": "typo", "colour": "red"}, {"prompt": "x", "num_frames": 10_000})
    r = api.client.post("/v1/batches", files={"file": ("n.jsonl", lines)},
                        data={"defaults": json.dumps(DEFAULTS)}, headers=api.auth("alice"))
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert [(e["line"], e["field"]) for e in errors] == [
        (2, "line 2: width"), (3, "line 3: colour"), (4, "line 4: num_frames")]
    assert errors[0]["message"] == "must be a multiple of 16, got 60; nearest: 48 or 64"
    assert errors[1]["message"] == "unknown field"
    assert r.json()["detail"].startswith("line 2: width: must be a multiple of 16")
    assert api.snapshot() == before
    assert not list(api.redis.scan_iter(match=f"{api.settings.redis_prefix}ready:*"))


def test_window_defaults_and_class_mistakes_are_named_once_or_per_line(api) -> None:
    now = datetime.now(UTC)
    backwards = {"not_before": _iso(now + timedelta(hours=2)),
                 "deadline": _iso(now + timedelta(hours=1))}
    r = _post(api, {"defaults": DEFAULTS, "window": backwards, "jobs": [{"prompt": "a"}]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "window.deadline"
    r = _post(api, {"defaults": {**DEFAULTS, "height": 7}, "jobs": [{"prompt": "a"}] * 3})
    assert [e["field"] for e in r.json()["errors"]] == ["defaults.height"]
    r = _post(api, {"defaults": DEFAULTS, "window": {"not_before": _iso(now)},
                    "jobs": [{"prompt": "a", "class": "interactive"},
                             {"prompt": "b", "not_before": _iso(now)}]})
    assert [(e["field"], e["message"]) for e in r.json()["errors"]] == [
        ("line 1: class", "every job of a batch has class 'batch'"),
        ("line 2: not_before", "the batch window sets it for every job")]
    r = _post(api, {"defaults": DEFAULTS, "jobs": []})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "jobs"


def test_queued_limit_counts_the_whole_batch_429_and_a_batch_over_it_is_422(api) -> None:
    limit = api.settings.max_queued_jobs_per_user  # 5
    assert _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "a"}] * 3}).status_code == 201
    r = _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "b"}] * 3})
    assert r.status_code == 429
    assert r.headers["Retry-After"] == str(api.settings.queue_full_retry_after_seconds)
    assert "you have 3 queued jobs and these 3" in r.json()["detail"]
    r = _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "c"}] * (limit + 1)}, who="bob")
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "jobs"
    assert _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "d"}] * 2}).status_code == 201


def test_batches_have_their_own_body_limit(api) -> None:
    padding = " " * (api.settings.max_body_bytes + 1)  # valid JSON, over the jobs' limit
    raw = json.dumps({"defaults": DEFAULTS, "jobs": [{"prompt": "a"}]})[:-1] + padding + "}"
    headers = {**api.auth("alice"), "Content-Type": "application/json"}
    assert api.client.post("/v1/jobs", content=raw, headers=headers).status_code == 413
    assert api.client.post("/v1/batches", content=raw, headers=headers).status_code == 201
    settings = api.settings.model_copy(
        update={"max_batch_body_bytes": api.settings.max_body_bytes})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    with TestClient(app) as client:
        r = client.post("/v1/batches", content=raw, headers=headers)
    assert r.status_code == 413 and str(settings.max_batch_body_bytes) in r.json()["detail"]


def test_same_idempotency_key_and_body_returns_the_same_batch(api) -> None:
    body = {"defaults": DEFAULTS, "jobs": [{"prompt": "a"}, {"prompt": "b"}]}
    first = _post(api, body, **{"Idempotency-Key": "night-7"})
    again = _post(api, body, **{"Idempotency-Key": "night-7"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    other = _post(api, {**body, "jobs": [{"prompt": "c"}]}, **{"Idempotency-Key": "night-7"})
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
    with api.session() as s:
        assert len(list(s.scalars(select(Job)))) == 2
        assert len(list(s.scalars(select(Batch)))) == 1


def test_other_users_batches_are_404_admins_see_all_and_lists_page_with_a_cursor(api) -> None:
    ids = [_post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": f"p{i}"}]}).json()["id"]
           for i in range(3)]
    for path in ("", "/report"):
        assert api.client.get(f"/v1/batches/{ids[0]}{path}",
                              headers=api.auth("bob")).status_code == 404
    assert api.client.post(f"/v1/batches/{ids[0]}/cancel",
                           headers=api.auth("bob")).status_code == 404
    assert api.client.get("/v1/batches", headers=api.auth("bob")).json()["data"] == []
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/batches", params=params, headers=api.auth("alice")).json()
        seen += [b["id"] for b in page["data"]]
        cursor = page["next_cursor"]
        assert page["has_more"] == (cursor is not None)
        if cursor is None:
            break
    assert seen == ids[::-1]  # newest first
    admin = api.client.get("/v1/batches", headers=api.auth("root")).json()["data"]
    assert {(b["id"], b["owner"]) for b in admin} == {(i, "alice") for i in ids}
    assert api.client.get(f"/v1/batches/{ids[0]}", headers=api.auth("root")).status_code == 200
    bad = api.client.get("/v1/batches", params={"cursor": "nonsense"}, headers=api.auth("alice"))
    assert bad.status_code == 422


def test_cancel_ends_queued_jobs_at_once_and_flags_running_ones(api) -> None:
    batch = _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": f"p{i}"} for i in range(3)]})
    batch_id = batch.json()["id"]
    rows = _jobs(api, batch_id)
    with api.session() as s:
        claim = lifecycle.claim_job(s, rows[0].id, worker_group_id="g", rank=0, lease_seconds=60)
        assert claim is not None
        lifecycle.heartbeat(s, rows[0].id, claim.attempt_token, step=1, lease_seconds=60)
    r = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth("alice"))
    assert r.status_code == 200, r.text
    assert (r.json()["cancelled"], r.json()["cancel_requested"]) == (2, 1)
    assert r.json()["batch"]["counts"]["cancelled"] == 2
    assert r.json()["batch"]["counts"]["running"] == 1
    key = queue_index.ready_key(api.settings.redis_prefix, "batch", 5)
    assert [api.redis.zscore(key, j.id) for j in rows[1:]] == [None, None]
    with api.session() as s:
        states = {j.id: (j.state, j.cancel_requested) for j in s.scalars(
            select(Job).where(Job.batch_id == batch_id))}
        assert states == {rows[0].id: ("running", True), rows[1].id: ("cancelled", True),
                          rows[2].id: ("cancelled", True)}
        kinds = sorted(e.kind for j in rows for e in queries.job_events(s, j.id))
        assert kinds.count("cancelled") == 2 and kinds.count("cancel_requested") == 1
        beat = lifecycle.heartbeat(s, rows[0].id, claim.attempt_token, step=2, lease_seconds=60)
        assert beat is not None and beat.cancel_requested
        assert lifecycle.finish_cancelled(s, rows[0].id, claim.attempt_token)
    done = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth("alice"))
    assert done.status_code == 409


def test_progress_and_eta_follow_finished_jobs(api) -> None:
    batch_id = _post(api, {"defaults": DEFAULTS,
                           "jobs": [{"prompt": f"p{i}"} for i in range(4)]}).json()["id"]
    rows = _jobs(api, batch_id)
    with api.session() as s:
        claim = lifecycle.claim_job(s, rows[1].id, worker_group_id="g", rank=1, lease_seconds=60)
        assert claim is not None
        lifecycle.heartbeat(s, rows[1].id, claim.attempt_token, step=2, lease_seconds=60)
        # Started a minute ago, so the pace (and the ETA, rounded to 0.1 s) is not ~0 on a
        # fast machine.
        s.execute(update(Job).where(Job.id == rows[1].id)
                  .values(started_at=claim.job.started_at - timedelta(minutes=1)))
        s.commit()
    running = api.client.get(f"/v1/batches/{batch_id}", headers=api.auth("alice")).json()
    assert running["status"] == "running" and running["eta"] is None
    assert running["progress"]["step_fraction"] == round(0.5 / 4, 4)
    api.finish(rows[0].id)
    after = api.client.get(f"/v1/batches/{batch_id}", headers=api.auth("alice")).json()
    assert after["progress"]["finished"] == 1 and after["progress"]["fraction"] == 0.25
    assert after["progress"]["step_fraction"] == round(1.5 / 4, 4)
    assert after["eta_seconds"] is not None and after["eta_seconds"] > 0
    assert datetime.fromisoformat(after["eta"]) > datetime.now(UTC)
    assert after["started_at"] is not None and after["finished_at"] is None


def test_report_counts_final_states_with_reasons_throughput_render_time_and_links(api) -> None:
    batch_id = _post(api, {"defaults": DEFAULTS,
                           "jobs": [{"prompt": f"p{i}"} for i in range(5)]}).json()["id"]
    rows = _jobs(api, batch_id)
    api.finish(rows[0].id)
    api.finish(rows[1].id)
    with api.session() as s:
        claim = lifecycle.claim_job(s, rows[2].id, worker_group_id="g", rank=0, lease_seconds=60)
        assert claim is not None
        lifecycle.fail_job(s, rows[2].id, claim.attempt_token, error="the prompt is too hard")
        past = datetime.now(UTC) - timedelta(seconds=1)
        s.execute(update(Job).where(Job.id == rows[3].id).values(deadline=past))
        s.commit()
        assert lifecycle.reap(s).expired == [rows[3].id]
    api.client.post(f"/v1/jobs/{rows[4].id}/cancel", headers=api.auth("alice"))
    r = api.client.get(f"/v1/batches/{batch_id}/report", headers=api.auth("alice"))
    assert r.status_code == 200, r.text
    report = r.json()
    counts = report["counts"]
    assert (counts["succeeded"], counts["failed"], counts["expired"], counts["cancelled"]) == (
        2, 1, 1, 1)
    assert report["num_jobs"] == 5
    assert [(p["id"], p["status"], p["error"]["message"]) for p in report["problems"]] == [
        (rows[2].id, "failed", "the prompt is too hard"),
        (rows[3].id, "expired", "its deadline passed before it could start")]
    fresh = _jobs(api, batch_id)
    ran = [j for j in fresh if j.started_at is not None]
    active = (max(j.finished_at for j in ran) - min(j.started_at for j in ran)).total_seconds()
    assert report["active_seconds"] == round(active, 3)
    assert report["videos_per_hour"] == round(2 / (active / 3600), 2)
    assert report["total_render_seconds"] == round(sum(j.render_seconds or 0 for j in fresh), 3)
    assert report["finished_at"] is not None
    links = {j["id"]: (j["video_url"], j["thumbnail_url"]) for j in report["jobs"]}
    assert links[rows[0].id] == (f"/v1/jobs/{rows[0].id}/video",
                                 f"/v1/jobs/{rows[0].id}/thumbnail")
    assert links[rows[2].id] == (None, None)
    assert [j["line"] for j in report["jobs"]] == [1, 2, 3, 4, 5]
    batch = api.client.get(f"/v1/batches/{batch_id}", headers=api.auth("alice")).json()
    assert batch["status"] == "finished" and batch["eta"] is None
    assert batch["progress"] == {"finished": 5, "total": 5, "fraction": 1.0,
                                 "step_fraction": 1.0}


def test_jsonl_lines_end_only_at_newlines_and_a_byte_order_mark_is_ignored(api) -> None:
    lines = "\ufeff" + json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\r\n" + \
        json.dumps({"prompt": "c"}) + "\n"
    r = api.client.post("/v1/batches", content=lines.encode(), params={
        "defaults": json.dumps(DEFAULTS)}, headers={**api.auth("alice"),
                                                    "Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    rows = _jobs(api, r.json()["id"])
    assert [(j.batch_index, j.prompt) for j in rows] == [(1, "a\u2028b"), (2, "c")]
    job = api.client.get(f"/v1/jobs/{rows[0].id}", headers=api.auth("alice")).json()
    assert job["batch_id"] == r.json()["id"] and job["class"] == "batch"


def test_a_file_of_many_bad_lines_reports_the_first_twenty_and_says_it_stopped(api) -> None:
    settings = api.settings.model_copy(update={"max_queued_jobs_per_user": 100})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    lines = _jsonl(*[{"prompt": "", "width": 64} for _ in range(50)])
    with TestClient(app) as client:
        r = client.post("/v1/batches", content=lines, headers={
            **api.auth("alice"), "Content-Type": "application/x-ndjson"})
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert [e.get("line") for e in errors[:-1]] == list(range(1, 21))
    assert errors[-1] == {"field": "jobs", "message": "stopped checking after 20 bad lines",
                          "type": "value_error"}


def test_a_batch_takes_its_own_webhook_and_refuses_an_unknown_event_naming_the_field(api) -> None:  # noqa: ANN001
    hook = "https://hooks.example.com/kiln"
    made = _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "p"}], "webhook_url": hook,
                       "webhook_events": ["batch.completed"]})
    assert made.status_code == 201, made.text
    assert (made.json()["webhook_url"], made.json()["webhook_events"]) == (
        hook, ["batch.completed"])
    bad = _post(api, {"defaults": DEFAULTS, "jobs": [{"prompt": "p"}], "webhook_url": hook,
                      "webhook_events": ["job.succeeded"]})
    assert bad.status_code == 422
    assert [e["field"] for e in bad.json()["errors"]] == ["webhook_events.0"]
    lines = api.client.post(
        f"/v1/batches?webhook_url={hook}&webhook_events=batch.completed", content=_jsonl(
            {"prompt": "p", **DEFAULTS}), headers={**api.auth("alice"),
                                                  "Content-Type": "application/x-ndjson"})
    assert lines.status_code == 201, lines.text
    with api.session() as s:
        row = s.get(Batch, lines.json()["id"])
        assert row is not None and (row.webhook_url, row.webhook_events) == (
            hook, ["batch.completed"])
