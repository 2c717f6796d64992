"""The dashboard page and the summary it polls."""

from __future__ import annotations


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
