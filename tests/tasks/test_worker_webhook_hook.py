"""The worker group's coordinator asks for a finished job's webhook right after the job's final
state is committed (the sweeper remains the safety net)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from task_helpers import make_settings, submit

from kiln.tasks import Context
from kiln.worker import WorkerConfig, make_coordinator
from runtime.rank_loop import Ended
from runtime.sequence import Layout
from storage import lifecycle
from storage.outputs import video_key
from storage.tables import Job


def test_finishing_a_job_with_a_webhook_enqueues_its_delivery_and_others_enqueue_nothing(
        db: Any, ctx: Context, redis_prefix: str, tmp_path: Path) -> None:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    with ctx.sessions() as s:
        hooked = submit(s, webhook_url="http://127.0.0.1:9/hook").id
        plain = submit(s).id
        tokens = {}
        for job_id in (hooked, plain):
            claim = lifecycle.claim_job(s, job_id, worker_group_id="g", rank=0, lease_seconds=600)
            assert claim is not None
            tokens[job_id] = claim.attempt_token
    # The coordinator's own Celery app, made from its settings, enqueues on their Redis.
    coordinator = make_coordinator(settings, WorkerConfig(), Layout(), "cpu")
    try:
        coordinator.record([
            Ended(rank=0, job_id=job_id, attempt_token=tokens[job_id], step=4,
                  num_inference_steps=4, outcome="succeeded", video_key=video_key(job_id))
            for job_id in (hooked, plain)])
    finally:
        coordinator.io.close()

    with ctx.sessions() as s:
        assert {s.get(Job, j).state for j in (hooked, plain)} == {"succeeded"}  # type: ignore[union-attr]
    # The broker queue (under the deployment's prefix) holds exactly one task: hooked's webhook.
    queued = [json.loads(m) for m in ctx.redis.lrange(f"{redis_prefix}celery:celery", 0, -1)]
    assert [(m["headers"]["task"], m["headers"]["argsrepr"]) for m in queued] == [
        ("kiln.deliver_webhook", repr((hooked,)))]
