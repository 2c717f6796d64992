"""The dashboard page and the summary it polls."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta


def _submit(api, who: str) -> str:  # noqa: ANN001
    body = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
            "num_inference_steps": 4}
    r = api.client.post("/v1/jobs", json=body, headers=api.auth(who))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_dashboard_page_is_served_without_a_key_and_holds_no_data(api) -> None:  # noqa: ANN001
    r = api.client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/summary" in r.text and "Worker groups" in r.text


def test_summary_counts_only_the_callers_jobs_unless_admin(api) -> None:  # noqa: ANN001
    done = _submit(api, "alice")
    _submit(api, "alice")
    _submit(api, "bob")
    api.finish(done)
    alice = api.client.get("/v1/summary", headers=api.auth("alice")).json()
    assert alice == {"jobs_by_state": {"queued": 1, "succeeded": 1}, "videos_last_hour": 1}
    bob = api.client.get("/v1/summary", headers=api.auth("bob")).json()
    assert bob == {"jobs_by_state": {"queued": 1}, "videos_last_hour": 0}
    root = api.client.get("/v1/summary", headers=api.auth("root")).json()
    assert root == {"jobs_by_state": {"queued": 2, "succeeded": 1}, "videos_last_hour": 1}


def test_summary_needs_a_key(api) -> None:  # noqa: ANN001
    assert api.client.get("/v1/summary").status_code == 401


def test_dashboard_page_shows_batches_and_escapes_user_text(api) -> None:  # noqa: ANN001
    page = api.client.get("/dashboard").text
    assert "<h2>Batches</h2>" in page and "/v1/batches?limit=" in page and "/report" in page
    # Names, prompts, errors and owners are user text: the page reads them only to test them
    # (`b.name ? ...`) or to put them through esc().
    uses = list(re.finditer(r"\b[a-z]\.(name|prompt|error|owner)\b", page))
    assert len(uses) >= 6
    for use in uses:
        assert page[:use.start()].endswith("esc(") or re.match(r"\s*\?", page[use.end():]), (
            page[use.start() - 40:use.end() + 20])


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
