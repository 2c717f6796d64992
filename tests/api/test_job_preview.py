"""``GET /v1/jobs/{id}/preview``: a running job's newest preview frame, as the worker stored it,
to a key that may see the job; a 404 with the reason before there is one, once the job is no
longer running, for a model that offers none, and for anyone else's job. The job page shows it
while the job runs."""

from __future__ import annotations

import numpy as np

from storage import lifecycle
from storage.outputs import preview_key, video_key
from storage.video import OutputWriter

JOB = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4}


def _running(api, model: str = "kiln-tiny") -> tuple[str, str]:  # noqa: ANN001
    """A job of ``model``, claimed as a worker would; (its id, the attempt token)."""
    r = api.client.post("/v1/jobs", json={**JOB, "model": model}, headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    with api.session() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id="test-group", rank=0,
                                    lease_seconds=60)
        assert claim is not None
        lifecycle.heartbeat(s, job_id, claim.attempt_token, step=2, num_inference_steps=4,
                            lease_seconds=60)
    return job_id, claim.attempt_token


def _frame() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, size=(64, 64, 3), dtype=np.uint8)


def _preview(api, job_id: str, who: str = "alice"):  # noqa: ANN001, ANN202
    return api.client.get(f"/v1/jobs/{job_id}/preview", headers=api.auth(who))


def test_a_running_jobs_preview_is_404_until_stored_then_the_png_uncached(api) -> None:  # noqa: ANN001
    job_id, _ = _running(api)
    r = _preview(api, job_id)
    assert r.status_code == 404 and r.json()["detail"] == "no preview of this job yet"
    OutputWriter(api.store).preview(_frame(), job_id, 2, 4)
    r = _preview(api, job_id)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["kiln-preview-step"] == "2/4"
    with api.store.open(preview_key(job_id)) as stored:
        assert r.content == stored.read()
    assert _preview(api, job_id, "root").status_code == 200  # an admin sees every job
    # Another user's job is not found, as for its thumbnail.
    r = _preview(api, job_id, "bob")
    assert r.status_code == 404 and r.json()["detail"] == "job not found"


def test_no_preview_once_the_job_is_not_running_or_for_a_model_without_one(api) -> None:  # noqa: ANN001
    r = api.client.post("/v1/jobs", json=JOB, headers=api.auth("alice"))
    queued = r.json()["id"]
    assert _preview(api, queued).json()["detail"] == \
        "the job is queued; a preview exists only while it runs"
    job_id, token = _running(api)
    OutputWriter(api.store).preview(_frame(), job_id, 2, 4)
    with api.session() as s:
        assert lifecycle.finish_succeeded(s, job_id, token, video_key=video_key(job_id))
    r = _preview(api, job_id)
    assert r.status_code == 404
    assert r.json()["detail"] == "the job is succeeded; a preview exists only while it runs"
    big, _ = _running(api, "kiln-big")
    r = _preview(api, big)
    assert r.status_code == 404 and r.json()["detail"] == "the model kiln-big offers no preview"


def test_the_job_page_shows_the_preview_while_a_kiln_tiny_job_runs(api) -> None:  # noqa: ANN001
    job_id, token = _running(api)
    page = api.client.get(f"/dashboard/jobs/{job_id}", headers=api.auth("alice")).text
    assert f'<img class="preview" data-src="/v1/jobs/{job_id}/preview"' in page
    assert "<figcaption>current estimate, step 2 of 4</figcaption>" in page
    big, _ = _running(api, "kiln-big")
    page = api.client.get(f"/dashboard/jobs/{big}", headers=api.auth("alice")).text
    assert 'class="preview"' not in page
    with api.session() as s:
        lifecycle.finish_succeeded(s, job_id, token, video_key=video_key(job_id))
    page = api.client.get(f"/dashboard/jobs/{job_id}", headers=api.auth("alice")).text
    assert 'class="preview"' not in page
