"""What a job's successful attempt cost its replica: the block gathers its steps took part in
and the blocks they computed (`storage.lifecycle.finish_succeeded`'s ``gathers`` and
``blocks_computed``, from the rank's final status), shown on the job and its page, and
kept in its "succeeded" event; null until then, and ``blocks_computed`` null where no step
cache counts."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from storage.tables import JobEvent


@pytest.mark.parametrize(("gathers", "blocks_computed"), [(120, 61), (0, None)])
def test_a_jobs_gathers_and_computed_blocks_are_recorded_and_shown(api, gathers,  # noqa: ANN001
                                                                    blocks_computed):
    r = api.client.post("/v1/jobs", json={"prompt": "a red circle", "width": 64, "height": 64,
                                          "num_frames": 9, "num_inference_steps": 4,
                                          "quality": "fast"}, headers=api.auth("alice"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert r.json()["gathers"] is None and r.json()["blocks_computed"] is None
    api.finish(job_id, gathers=gathers, blocks_computed=blocks_computed)
    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth("alice")).json()
    assert (job["gathers"], job["blocks_computed"]) == (gathers, blocks_computed)
    with api.session() as s:
        done = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id,
                                                JobEvent.kind == "succeeded")).one()
        assert done.detail["gathers"] == gathers
    page = api.client.get(f"/dashboard/jobs/{job_id}", headers=api.auth("alice")).text
    assert f'<span id="gathers">{gathers}</span>' in page
    assert ("blocks computed" in page) is (blocks_computed is not None)
    assert "<th>quality</th><td>fast</td>" in page
