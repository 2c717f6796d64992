"""The batch page, ``GET /dashboard/batches/{id}``: the morning report rendered on the server for a
key that may see the batch (the figures of ``/v1/batches/{id}/report``), a shell without a key,
a 404 for anyone else's batch."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from storage import lifecycle
from storage.tables import Job

DEFAULTS = {"model": "kiln-tiny", "width": 64, "height": 64, "num_frames": 9,
            "num_inference_steps": 4}
T0 = datetime(2026, 1, 1, 22, 0, tzinfo=UTC)


def _batch(api, who: str = "alice", **body: object) -> tuple[str, list[str]]:  # noqa: ANN001
    r = api.client.post("/v1/batches", headers=api.auth(who), json={
        "defaults": DEFAULTS, "jobs": [{"prompt": f"prompt <{i}>"} for i in range(4)], **body})
    assert r.status_code == 201, r.text
    batch_id = str(r.json()["id"])
    with api.session() as s:
        jobs = list(s.scalars(select(Job.id).where(Job.batch_id == batch_id)
                              .order_by(Job.batch_index)))
    return batch_id, jobs


def _section(page: str, title: str) -> str:
    start = page.index(f"<h2>{title}")
    return page[start:page.index("</section>", start)]


def test_the_page_shows_the_morning_report_and_escapes_the_name(api) -> None:  # noqa: ANN001
    batch_id, jobs = _batch(api, name="<b>night</b>", window={
        "deadline": (datetime.now(UTC) + timedelta(days=1)).isoformat()})
    api.finish(jobs[0])
    api.finish(jobs[1])
    with api.session() as s:
        claim = lifecycle.claim_job(s, jobs[2], worker_group_id="g", rank=0, lease_seconds=60)
        assert claim is not None
        lifecycle.fail_job(s, jobs[2], claim.attempt_token, error="out of <memory>",
                           code="oom")
        # Known times: two videos of 90 s and 30 s over the half hour the batch ran.
        for job_id, started, ended, took in ((jobs[0], 0, 20, 90.0), (jobs[1], 5, 30, 30.0),
                                             (jobs[2], 10, 12, None)):
            s.execute(update(Job).where(Job.id == job_id).values(
                started_at=T0 + timedelta(minutes=started),
                finished_at=T0 + timedelta(minutes=ended), render_seconds=took))
        s.commit()
    assert api.client.post(f"/v1/jobs/{jobs[3]}/cancel",
                           headers=api.auth("alice")).status_code == 200
    report = api.client.get(f"/v1/batches/{batch_id}/report", headers=api.auth("alice")).json()
    assert report["videos_per_hour"] == 4.0 and report["total_render_seconds"] == 120.0

    r = api.client.get(f"/dashboard/batches/{batch_id}", headers=api.auth("alice"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    page = r.text
    assert '<link rel="stylesheet" href="/dashboard/assets/kiln.css">' in page
    assert ('<script src="/dashboard/assets/kiln.js"></script>\n'
            '<script src="/dashboard/assets/page.js"></script>\n'
            '<script src="/dashboard/assets/batch_page.js"></script>') in page
    assert "&lt;b&gt;night&lt;/b&gt;" in page and "<b>night</b>" not in page
    assert "prompt &lt;0&gt;" in page and "<0>" not in page
    assert f'data-batch="{batch_id}"' in page and 'data-terminal="true"' in page
    assert '<span class="chip finished">finished</span>' in page
    assert 'id="bar"\n      style="width:100%"' in page and "4/4 jobs ended" in page
    head = _section(page, "Batch")
    assert "<th>window</th>" in head and "→ <time datetime=" in head
    assert "<th>owner</th>" not in head  # only admins see the owner

    cards = _section(page, "Morning report")
    figures = {label: value for value, label in
               re.findall(r'<div class="n">(.*?)</div><div class="l">(.*?)</div>', cards)}
    assert figures == {"succeeded": "2", "failed": "1", "expired": "0", "cancelled": "1",
                       "dead": "0", "videos per hour": "4", "render time": "2.0 min",
                       "mean render time": "60.0 s"}
    assert "over 30.0 min of running" in cards

    problems = _section(page, "Failed, expired and dead")
    assert f'<a class="mono" href="/dashboard/jobs/{jobs[2]}">{jobs[2]}</a>' in problems
    assert "out of &lt;memory&gt;" in problems and '<span class="mono dim">oom</span>' in problems
    table = _section(page, "Jobs")
    assert [table.index(f'href="/dashboard/jobs/{j}"') for j in jobs] == sorted(
        table.index(f'href="/dashboard/jobs/{j}"') for j in jobs)  # in line order
    assert table.count('<span class="chip succeeded">succeeded</span>') == 2
    assert '<span class="chip cancelled">cancelled</span>' in table
    assert "<td class=\"nowrap\">90.0 s</td>" in table  # the first video's render time

    admin = api.client.get(f"/dashboard/batches/{batch_id}", headers=api.auth("root")).text
    assert "<th>owner</th><td>alice</td>" in admin


def test_a_running_batch_goes_live_with_its_eta(api) -> None:  # noqa: ANN001
    batch_id, jobs = _batch(api)
    api.finish(jobs[0])
    page = api.client.get(f"/dashboard/batches/{batch_id}", headers=api.auth("alice")).text
    assert 'data-terminal="false"' in page and 'data-last-event="' in page
    assert '<span class="chip running">running</span>' in page
    assert "1/4 jobs ended" in page
    assert "<th>ETA</th><td><time datetime=" in page
    assert "Failed, expired and dead" not in page  # no problems, no section
    script = api.client.get("/dashboard/assets/page.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "kiln.live({" in script.text  # /v1/events, polling as the fallback (kiln.js)
    own = api.client.get("/dashboard/assets/batch_page.js").text
    assert 'd.type === "batch" && d.id === batchId' in own


def test_anyone_elses_batch_is_a_404_and_without_a_key_the_page_is_an_empty_shell(api) -> None:  # noqa: ANN001
    batch_id, _ = _batch(api, name="secret night")
    assert api.client.get(f"/dashboard/batches/{batch_id}",
                          headers=api.auth("bob")).status_code == 404
    assert api.client.get("/dashboard/batches/nosuchbatch",
                          headers=api.auth("alice")).status_code == 404
    shell = api.client.get(f"/dashboard/batches/{batch_id}")
    assert shell.status_code == 200 and 'data-shell="true"' in shell.text
    assert "secret" not in shell.text and "<table" not in shell.text  # holds no data
    assert "script-src 'self'" in shell.headers["Content-Security-Policy"]
    bad = api.client.get(f"/dashboard/batches/{batch_id}",
                         headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
