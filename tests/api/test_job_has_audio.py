"""Whether a job's video has a soundtrack: recorded on the job when its video is stored
(`storage.lifecycle.finish_succeeded`'s ``has_audio``) and shown in its job and video bodies;
null until then."""

from __future__ import annotations

import pytest

from storage.tables import Job


def _submit(api, prompt: str) -> str:  # noqa: ANN001
    r = api.client.post("/v1/jobs", json={"prompt": prompt, "width": 64, "height": 64,
                                          "num_frames": 9, "num_inference_steps": 4},
                        headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    assert r.json()["has_audio"] is None
    return r.json()["id"]


@pytest.mark.parametrize("has_audio", [True, False, None])
def test_has_audio_is_written_with_the_video_and_shown_on_the_job_and_the_video(api, has_audio):
    job_id = _submit(api, "a red circle")
    video = api.client.get(f"/v1/videos/{job_id}", headers=api.auth("alice"))
    assert video.status_code == 200, video.text
    assert video.json()["has_audio"] is None
    api.finish(job_id, has_audio=has_audio)
    with api.session() as s:
        assert s.get(Job, job_id).has_audio is has_audio
    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("alice")).json()
    assert job["status"] == "succeeded" and job["has_audio"] is has_audio
    video = api.client.get(f"/v1/videos/{job_id}", headers=api.auth("alice")).json()
    assert video["status"] == "completed" and video["has_audio"] is has_audio
