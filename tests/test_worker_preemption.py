"""One worker group, mixed work, against real servers and a real worker: an interactive job
that finds the only replica busy with batch work suspends it in place and renders first; a
drained job resumes from the checkpoint its ranks wrote on the way out."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from servers import api_client, job_row, serving_api, wait_job, worker_group

from storage import queries
from storage.outputs import checkpoint_key

# Group scenarios: `make test` runs them on PostgreSQL, `make chaos` on SQLite as well.
pytestmark = pytest.mark.fault

# ~0.15 s a step on a CPU rank: long enough to be running when the interactive job comes.
BATCH = {"model": "kiln-tiny", "prompt": "a red circle moving left", "width": 256,
         "height": 256, "num_frames": 17, "num_inference_steps": 60, "fps": 8, "seed": 3,
         "class": "batch"}
INTERACTIVE = {"model": "kiln-tiny", "prompt": "a blue square", "width": 64, "height": 64,
               "num_frames": 9, "num_inference_steps": 4, "fps": 8, "seed": 4}


def _ended(job: dict[str, Any]) -> bool:
    return job["status"] not in ("queued", "running")


def test_an_interactive_job_suspends_the_batch_job_on_the_only_replica_and_ends_first(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client, worker_group(service, dp=1):
        batch = client.post("/v1/jobs", json=BATCH).json()["id"]
        wait_job(client, batch, timeout=60,
                 until=lambda j: j["status"] == "running" and j["step"] >= 2)
        quick = client.post("/v1/jobs", json=INTERACTIVE).json()["id"]
        done = wait_job(client, quick, timeout=60, until=_ended)
        assert done["status"] == "succeeded", done
        assert job_row(service, batch).state == "running", "the batch job ended first"
        final = wait_job(client, batch, timeout=120, until=_ended)
        assert final["status"] == "succeeded", final
        assert final["preemptions"] == 1 and final["attempts"] == 1, final
        with service.db.session() as s:
            kinds = [e.kind for e in queries.job_events(s, batch)]
        assert kinds.index("preempted") < kinds.index("continued"), kinds


@pytest.mark.chaos  # slow: `make chaos` runs it (and test_rank_kill_resume's drain cases)
def test_a_drained_job_resumes_from_the_step_its_ranks_checkpointed_on_the_way_out(
        db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> None:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice",)) as service, \
            api_client(service) as client:
        job_id = client.post("/v1/jobs", json=BATCH).json()["id"]
        with worker_group(service, dp=2, args=["--drain-seconds", "0.5"]) as group:
            seen = wait_job(client, job_id, timeout=60,
                            until=lambda j: j["status"] == "running" and j["step"] >= 5)["step"]
            os.killpg(group.pid, signal.SIGTERM)
            assert group.wait(timeout=30) == 0
        assert job_row(service, job_id).state == "queued"
        assert service.store.exists(checkpoint_key(job_id))
        with worker_group(service, dp=2):
            done = wait_job(client, job_id, timeout=120, until=_ended)
        assert done["status"] == "succeeded", done
        # Nothing recomputed: the second attempt starts where the first one's ranks stopped
        # (past the step seen before the SIGTERM: the drain went on rendering).
        assert done["resumed_from_step"] >= seen, done
        assert not service.store.exists(checkpoint_key(job_id))
        with service.db.session() as s:
            kinds = [e.kind for e in queries.job_events(s, job_id)]
        assert "resumed" in kinds
