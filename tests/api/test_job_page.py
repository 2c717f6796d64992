"""The job page, ``GET /dashboard/jobs/{id}``: rendered on the server for a key that may see the
job, a shell without a key, a 404 for anyone else's job."""

from __future__ import annotations

import re
from datetime import timedelta

from media_files import png, video

from storage import lifecycle, webhooks
from storage.tables import Job, utcnow
from storage.workers import GroupReport, report_group

JOB = {"prompt": "a <b>red</b> circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4, "metadata": {"project": "<teaser>"}}


def _submit(api, who: str = "alice") -> str:  # noqa: ANN001
    r = api.client.post("/v1/jobs", json=JOB, headers=api.auth(who))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_a_finished_job_shows_its_video_thumbnail_parameters_and_timeline(api) -> None:  # noqa: ANN001
    with api.session() as s:
        report_group(s, GroupReport(id="test-group", name="group one", host="h",
                                    model="kiln-tiny", mode="allgather", platform="cpu",
                                    dp_size=1, world_size=1))
    job = _submit(api)
    api.finish(job)
    r = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert f'<video controls preload="metadata" data-src="/v1/jobs/{job}/video"' in page
    assert f'data-src="/v1/jobs/{job}/thumbnail"' in page
    assert '<script src="/dashboard/assets/job_page.js"></script>' in page
    assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    # User text is escaped.
    assert "a &lt;b&gt;red&lt;/b&gt; circle" in page and "<b>red</b>" not in page
    assert "&lt;teaser&gt;" in page
    # The timeline: created, the attempt with its group (by name), rank and outcome, finished.
    timeline = page[page.index('<ol class="timeline">'):page.index("</ol>")]
    assert timeline.index("created") < timeline.index("attempt 1 on worker group") \
        < timeline.index("finished:")
    assert 'title="test-group">group one</span>, rank 0' in timeline
    assert '<span class="chip succeeded">succeeded</span> after' in timeline
    assert 'id="cancel"' not in page and 'data-terminal="true"' in page
    # The video route the page points at serves the file to the same key.
    video = api.client.get(f"/v1/jobs/{job}/video", headers=api.auth("alice"))
    assert video.status_code == 200 and video.content == b"mp4"


def test_a_failed_job_shows_its_error(api) -> None:  # noqa: ANN001
    job = _submit(api)
    with api.session() as s:
        claim = lifecycle.claim_job(s, job, worker_group_id="gone-group", rank=1,
                                    lease_seconds=60)
        assert claim is not None
        lifecycle.fail_job(s, job, claim.attempt_token, error="out of memory: <4 GiB> free")
    page = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    assert '<pre class="error" id="job-error">out of memory: &lt;4 GiB&gt; free</pre>' in page
    assert "<video" not in page
    assert 'title="gone-group">gone-group</span>, rank 1' in page  # a group no longer known
    assert '<span class="chip failed">failed</span>' in page


def test_a_running_job_has_a_cancel_button_and_its_page_goes_live(api) -> None:  # noqa: ANN001
    job = _submit(api)
    page = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    assert '<button id="cancel"' in page and 'data-terminal="false"' in page
    assert 'data-last-event="' in page
    assert '<script src="/dashboard/assets/page.js"></script>' in page
    shared = api.client.get("/dashboard/assets/page.js")
    assert shared.status_code == 200 and "javascript" in shared.headers["content-type"]
    assert "kiln.live({" in shared.text  # /v1/events, polling as the fallback (kiln.js)
    script = api.client.get("/dashboard/assets/job_page.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "/cancel`, { method: \"POST\" }" in script.text


def test_anyone_elses_job_is_a_404_and_without_a_key_the_page_is_an_empty_shell(api) -> None:  # noqa: ANN001
    job = _submit(api)
    assert api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("bob")).status_code == 404
    assert api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("root")).status_code == 200
    assert api.client.get("/dashboard/jobs/nosuchjob",
                          headers=api.auth("alice")).status_code == 404
    shell = api.client.get(f"/dashboard/jobs/{job}")
    assert shell.status_code == 200 and 'data-shell="true"' in shell.text
    assert "circle" not in shell.text and "<table" not in shell.text  # holds no data
    bad = api.client.get(f"/dashboard/jobs/{job}", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401


def test_the_dashboard_links_its_jobs_to_their_pages(api) -> None:  # noqa: ANN001
    script = api.client.get("/dashboard/assets/dashboard.js").text
    assert '<a href="/dashboard/jobs/${encodeURIComponent(j.id)}">' in script


def test_a_job_with_a_webhook_shows_each_delivery_attempt(api) -> None:  # noqa: ANN001
    hook = "https://hooks.example.com/kiln?a=1&b=2"
    r = api.client.post("/v1/jobs", json={**JOB, "webhook_url": hook, "webhook_events": [
        "job.started", "job.succeeded"]}, headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    running = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    assert "the final event is sent when the job ends" in running
    assert '<p class="empty">no attempts yet</p>' in running
    api.finish(job)
    with api.session() as s:
        # What kiln.tasks records: job.started sent, the final event refused once, then sent.
        webhooks.log_attempt(s, job_id=job, event="job.started", msg_id=f"evt_{job}_started_1",
                             attempt=1, status=200, outcome="delivered")
        first = webhooks.begin_attempt(s, job, hold_seconds=60)
        assert first is not None
        webhooks.record_result(s, job, 1, delivered=False, status=500,
                               error="the receiver answered HTTP 500 <oops>",
                               retry_at=utcnow() - timedelta(seconds=1))
        webhooks.log_attempt(s, job_id=job, event="job.succeeded", msg_id=f"evt_{job}_succeeded",
                             attempt=1, status=500, error="the receiver answered HTTP 500 <oops>",
                             outcome="retrying")
        second = webhooks.begin_attempt(s, job, hold_seconds=60)
        assert second is not None and second.number == 2
        webhooks.record_result(s, job, 2, delivered=True, status=204)
        webhooks.log_attempt(s, job_id=job, event="job.succeeded", msg_id=f"evt_{job}_succeeded",
                             attempt=2, status=204, outcome="delivered")
    page = api.client.get(f"/dashboard/jobs/{job}", headers=api.auth("alice")).text
    start = page.index('<section id="deliveries">')
    section = page[start:page.index("</section>", start)]
    assert "https://hooks.example.com/kiln?a=1&amp;b=2" in section
    assert "asked for: job.started, job.succeeded" in section
    assert 'job.succeeded <span class="chip succeeded">delivered</span> at <time' in section
    assert "(attempt 2)" in section
    rows = re.findall(r'<tr><td class="nowrap"><time [^>]*>[^<]*</time></td>'
                      r'<td class="mono">(.*?)</td><td>(.*?)</td><td>(.*?)</td>'
                      r'<td><span class="chip [a-z]+">(.*?)</span></td></tr>', section)
    assert rows == [  # the newest first
        ("job.succeeded", "2", "HTTP 204", "delivered"),
        ("job.succeeded", "1",
         'HTTP 500 · <span class="dim">the receiver answered HTTP 500 &lt;oops&gt;</span>',
         "retrying"),
        ("job.started", "1", "HTTP 200", "delivered")]
    plain = _submit(api)
    assert "Webhook deliveries" not in api.client.get(
        f"/dashboard/jobs/{plain}", headers=api.auth("alice")).text


def test_a_job_shows_the_image_or_video_it_starts_from(api) -> None:  # noqa: ANN001
    image = png(40, 24)
    r = api.client.post("/v1/files", headers=api.auth("alice"), data={"purpose": "vision"},
                        files={"file": ("start<1>.png", image, "image/png")})
    assert r.status_code == 201, r.text
    file_id = r.json()["id"]
    r = api.client.post("/v1/jobs", json={**JOB, "input_file_id": file_id, "fit": "pad"},
                        headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["input_file_id"], job["fit"], job["strength"]) == (file_id, "pad", None)
    page = api.client.get(f"/dashboard/jobs/{job['id']}", headers=api.auth("alice")).text
    src = f"/v1/jobs/{job['id']}/input"
    section = page[page.index('<section id="input">'):]
    section = section[:section.index("</section>")]
    # Fetched with the key by job_page.js, like the outputs: data-src, not src.
    assert (f'<img class="thumb large" data-src="{src}" alt="input image" width="40" '
            'height="24">') in section
    assert "start&lt;1&gt;.png · image, 40×24</figcaption>" in section
    assert f'<th>input</th><td><span class="mono">{file_id}</span> (image)</td>' in page
    assert "<th>fit</th><td>pad</td>" in page and "<th>strength</th>" not in page
    # The file as uploaded, to whoever may see the job: its owner and an admin.
    for who in ("alice", "root"):
        r = api.client.get(src, headers=api.auth(who))
        assert (r.status_code, r.content, r.headers["content-type"]) == (200, image, "image/png")
    assert api.client.get(src, headers=api.auth("bob")).status_code == 404

    # A video to restyle, with a strength (set on the row: the test models take images only).
    r = api.client.post("/v1/files", headers=api.auth("alice"), data={"purpose": "video"},
                        files={"file": ("clip.mp4", video(), "video/mp4")})
    assert r.status_code == 201, r.text
    clip = r.json()
    with api.session() as s:
        row = s.get(Job, job["id"])
        row.input_file_id, row.input_fit, row.strength = clip["id"], "crop", 0.6
        s.commit()
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth("alice")).json()[
        "strength"] == 0.6
    page = api.client.get(f"/dashboard/jobs/{job['id']}", headers=api.auth("alice")).text
    assert f'<video controls muted preload="metadata" data-src="{src}"' in page
    assert "clip.mp4 · video, 16×16, 9 frames</figcaption>" in page
    assert "<th>fit</th><td>crop</td>" in page and "<th>strength</th><td>0.6</td>" in page
    r = api.client.get(src, headers=api.auth("alice"))
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"

    # Deleted: the job keeps its fit and says the file is gone; the route says so too.
    assert api.client.delete(f"/v1/files/{clip['id']}",
                             headers=api.auth("alice")).status_code == 200
    page = api.client.get(f"/dashboard/jobs/{job['id']}", headers=api.auth("alice")).text
    assert 'id="input"' not in page
    assert '<th>input</th><td><span class="dim">the file was deleted</span></td>' in page
    r = api.client.get(src, headers=api.auth("alice"))
    assert r.status_code == 404 and "deleted" in r.json()["error"]["message"]

    # A job from text alone shows no input at all.
    plain = _submit(api)
    page = api.client.get(f"/dashboard/jobs/{plain}", headers=api.auth("alice")).text
    assert 'id="input"' not in page and "<th>input</th>" not in page
    assert api.client.get(f"/v1/jobs/{plain}", headers=api.auth("alice")).json()[
        "input_file_id"] is None
    r = api.client.get(f"/v1/jobs/{plain}/input", headers=api.auth("alice"))
    assert r.status_code == 404 and "text only" in r.json()["error"]["message"]
