"""A job's resumes and preemptions as the API shows them: ``resumed_from_step`` and
``preemptions`` on the native job, nothing new on /v1/videos, the job page's line and timeline,
and the events in the live feed."""

from __future__ import annotations

from storage import feed, lifecycle

# An id with markup in it: every event detail is shown escaped.
BY = "<b>urgent</b>"


def _running(api) -> tuple[str, str]:  # noqa: ANN001
    r = api.client.post("/v1/jobs", json={"prompt": "a red circle", "width": 64, "height": 64,
                                          "num_frames": 9, "num_inference_steps": 30},
                        headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["resumed_from_step"], job["preemptions"]) == (None, 0)
    with api.session() as s:
        claim = lifecycle.claim_job(s, job["id"], worker_group_id="test-group", rank=0,
                                    lease_seconds=60)
        assert claim is not None
        return job["id"], claim.attempt_token


def test_the_job_says_where_it_resumed_from_and_how_often_it_was_preempted(api) -> None:  # noqa: ANN001
    job, token = _running(api)
    with api.session() as s:
        assert lifecycle.note_resumed(s, job, token, step=20)
        for _ in range(2):
            assert lifecycle.note_preempted(s, job, token, by_job=BY, step=24)
            assert lifecycle.note_continued(s, job, token, step=24)
    got = api.client.get(f"/v1/jobs/{job}", headers=api.auth("alice")).json()
    assert (got["resumed_from_step"], got["preemptions"]) == (20, 2)
    listed = api.client.get("/v1/jobs", headers=api.auth("alice")).json()["data"]
    assert (listed[0]["resumed_from_step"], listed[0]["preemptions"]) == (20, 2)
    # The OpenAI-compatible shape is unchanged.
    video = api.client.get(f"/v1/videos/{job}", headers=api.auth("alice")).json()
    assert "resumed_from_step" not in video and "preemptions" not in video
    schema = api.client.get("/openapi.json").json()["components"]["schemas"]["JobPublic"]
    assert "resumed from" in schema["properties"]["resumed_from_step"]["description"]
    assert "suspended" in schema["properties"]["preemptions"]["description"]

    page = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    assert '<span id="resumed">resumed from step 20</span>' in page
    assert '<span id="preemptions">preempted 2 times</span>' in page
    timeline = page[page.index('<ol class="timeline">'):page.index("</ol>")]
    assert timeline.index("attempt 1 on worker group") < timeline.index(
        "resumed from step 20 of 30") < timeline.index(
        'suspended at step 24 of 30 for interactive job <span class="mono">'
        "&lt;b&gt;urgent&lt;/b&gt;</span>") < timeline.index("continued at step 24 of 30")
    assert BY not in page

    # The live feed carries them (they change no state), in order.
    with api.session() as s:
        events = [e for e in feed.events_after(s, feed.EventCursor(0)) if e.job_id == job]
    kinds = [(e.kind, feed.STATE_AFTER.get(e.kind)) for e in events]
    assert kinds == [("created", "queued"), ("claimed", "running"), ("resumed", None),
                     ("preempted", None), ("continued", None), ("preempted", None),
                     ("continued", None)]


def test_a_job_that_did_not_resume_shows_no_resume_line(api) -> None:  # noqa: ANN001
    job, token = _running(api)
    with api.session() as s:
        assert lifecycle.note_preempted(s, job, token, by_job="b" * 20, step=0)
    page = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    assert 'id="resumed"' not in page
    assert '<span id="preemptions">preempted 1 time</span>' in page
    got = api.client.get(f"/v1/jobs/{job}", headers=api.auth("alice")).json()
    assert (got["resumed_from_step"], got["preemptions"]) == (None, 1)
