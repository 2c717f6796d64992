"""The dashboard page and the summary it polls."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from storage import lifecycle


def _submit(api, who: str) -> str:  # noqa: ANN001
    body = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
            "num_inference_steps": 4}
    r = api.client.post("/v1/jobs", json=body, headers=api.auth(who))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_dashboard_page_is_served_without_a_key_and_holds_no_data(api) -> None:  # noqa: ANN001
    r = api.client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    page = r.text
    for view in ("overview", "jobs", "workers", "batches"):
        assert f'data-view="{view}"' in page and f'href="#{view}"' in page
    assert '<script src="/dashboard/assets/dashboard.js"></script>' in page
    assert "<script>" not in page  # only kiln's own scripts run on it
    script = api.client.get("/dashboard/assets/dashboard.js")
    assert script.status_code == 200 and "/v1/summary" in script.text
    assert api.client.get("/dashboard/assets/nothing.js").status_code == 404
    assert api.client.get("/dashboard/assets/..%2Fapp.py").status_code == 404


def _fail(api, job_id: str, error: str) -> None:  # noqa: ANN001
    with api.session() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id="test-group", rank=0,
                                    lease_seconds=60)
        assert claim is not None
        lifecycle.fail_job(s, job_id, claim.attempt_token, error=error, code="render_failed")


def test_summary_counts_only_the_callers_jobs_unless_admin(api) -> None:  # noqa: ANN001
    done = _submit(api, "alice")
    _submit(api, "alice")
    _submit(api, "bob")
    api.finish(done)
    alice = api.client.get("/v1/summary", headers=api.auth("alice")).json()
    assert alice["jobs_by_state"] == {"queued": 1, "succeeded": 1}
    assert alice["jobs_by_class"] == {"interactive": {"queued": 1, "succeeded": 1}}
    assert alice["videos_last_hour"] == 1 and alice["videos_since_start"] == 1
    assert alice["queue_depth"] == 1 and alice["viewer"] == "alice" and not alice["is_admin"]
    bob = api.client.get("/v1/summary", headers=api.auth("bob")).json()
    assert bob["jobs_by_state"] == {"queued": 1} and bob["videos_last_hour"] == 0
    assert bob["videos_per_hour"] is None and bob["queue_eta_seconds"] is None
    root = api.client.get("/v1/summary", headers=api.auth("root")).json()
    assert root["jobs_by_state"] == {"queued": 2, "succeeded": 1} and root["is_admin"]


def test_summary_gives_throughput_the_queues_eta_and_the_hours_failures(api) -> None:  # noqa: ANN001
    jobs = [_submit(api, "alice") for _ in range(5)]
    api.finish(jobs[0])
    api.finish(jobs[1])
    _fail(api, jobs[2], "out of memory: <4 GiB> free")
    s = api.client.get("/v1/summary", headers=api.auth("alice")).json()
    # Two videos within a minute of their start: read over a minute at least, 120 an hour.
    assert s["videos_last_hour"] == 2 and s["videos_per_hour"] == pytest.approx(120, rel=0.05)
    assert s["queue_depth"] == 2
    assert s["queue_eta_seconds"] == pytest.approx(3600 * 2 / s["videos_per_hour"])
    assert s["failures_last_hour"] == 1
    [failure] = s["recent_failures"]
    assert failure["id"] == jobs[2] and failure["status"] == "failed"
    assert failure["error"] == "out of memory: <4 GiB> free"
    assert api.client.get("/v1/summary", headers=api.auth("bob")).json()["recent_failures"] == []


def test_summary_needs_a_key(api) -> None:  # noqa: ANN001
    assert api.client.get("/v1/summary").status_code == 401


def test_models_list_the_served_models_with_their_defaults_and_rules(api) -> None:  # noqa: ANN001
    r = api.client.get("/v1/models", headers=api.auth("alice"))
    assert r.status_code == 200
    [tiny] = [m for m in r.json()["data"] if m["id"] == "kiln-tiny"]
    assert tiny["defaults"]["width"] == 64 and tiny["defaults"]["num_frames"] == 9
    assert tiny["size_multiple"] == 16 and tiny["frame_stride"] == 4
    assert api.client.get("/v1/models").status_code == 401


def test_jobs_filter_by_class(api) -> None:  # noqa: ANN001
    body = {"prompt": "a red circle", "class": "batch"}
    r = api.client.post("/v1/jobs", json=body, headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    night = r.json()["id"]
    _submit(api, "alice")
    listed = api.client.get("/v1/jobs", params={"class": "batch"}, headers=api.auth("alice"))
    assert [j["id"] for j in listed.json()["data"]] == [night]
    bad = api.client.get("/v1/jobs", params={"class": "urgent"}, headers=api.auth("alice"))
    assert bad.status_code == 422


def test_dashboard_script_escapes_user_text(api) -> None:  # noqa: ANN001
    script = api.client.get("/dashboard/assets/dashboard.js").text
    # Names, prompts, errors, owners and reasons are user text: the script reads them only to
    # test them (`b.name ? ...`) or to put them through esc().
    uses = list(re.finditer(r"\b[a-z]\.(name|prompt|error|owner|reason)\b", script))
    assert len(uses) >= 8
    for use in uses:
        before, after = script[:use.start()], script[use.end():]
        assert (before.endswith("esc(") or re.match(r"\s*(\?|\|\||&&|\))", after)
                or re.match(r"\.message", after)), script[use.start() - 40:use.end() + 20]


def test_the_listed_batches_carry_what_the_panel_shows_to_their_owner_only(api) -> None:  # noqa: ANN001
    body = {"name": "<b>night</b>", "defaults": {"width": 64, "height": 64, "num_frames": 9,
                                                   "num_inference_steps": 4},
            "jobs": [{"prompt": "a red circle"}, {"prompt": "a blue square"}],
            "window": {"deadline": (datetime.now(UTC) + timedelta(days=1)).isoformat()}}
    r = api.client.post("/v1/batches", json=body, headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    listed = api.client.get("/v1/batches", params={"limit": 10}, headers=api.auth("alice"))
    assert listed.status_code == 200
    [batch] = listed.json()["data"]
    assert batch["name"] == "<b>night</b>" and batch["status"] == "queued"
    assert batch["counts"]["queued"] == 2 and batch["progress"]["total"] == 2
    assert batch["deadline"] is not None and batch["not_before"] is None
    fields = {"id", "created_at", "not_before", "deadline", "counts", "progress", "eta",
              "eta_seconds", "finished_at", "owner"}
    assert fields <= batch.keys()
    assert {"finished", "total", "step_fraction"} <= batch["progress"].keys()
    report = api.client.get(f"/v1/batches/{batch['id']}/report", headers=api.auth("alice"))
    assert report.status_code == 200
    assert api.client.get("/v1/batches", headers=api.auth("bob")).json()["data"] == []
    [seen] = api.client.get("/v1/batches", headers=api.auth("root")).json()["data"]
    assert seen["owner"] == "alice"


def test_assets_are_revalidated_at_every_load_and_only_scripts_and_styles_are_served(
        api) -> None:  # noqa: ANN001
    script = api.client.get("/dashboard/assets/page.js")
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert script.headers["cache-control"] == "no-cache"
    style = api.client.get("/dashboard/assets/kiln.css")
    assert style.headers["content-type"] == "text/css; charset=utf-8"
    again = api.client.get("/dashboard/assets/page.js",
                           headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"
    for name in ("nothing.js", "dashboard.html", "..%2Fdeps.py"):
        r = api.client.get(f"/dashboard/assets/{name}")
        assert r.status_code == 404, name
        assert r.json()["error"]["message"].startswith("no asset named"), r.text
