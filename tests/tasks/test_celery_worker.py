"""A real Celery worker process on kiln's Redis (under a prefix of its own) runs a task that was
enqueued with ``.delay`` from another process, including a retry after a failed POST, and retries
a live event as many times as webhook_max_attempts allows (not Celery's default of 3 retries)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import Receiver
from standardwebhooks import Webhook
from task_helpers import make_settings, secret_of, submit, succeed

from kiln import tasks
from kiln.tasks import Context
from storage import webhooks
from storage.tables import utcnow

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


@contextlib.contextmanager
def celery_worker(env: dict[str, str], log_path: Path) -> Iterator[None]:
    """``celery worker`` (one process, no pool) with ``env``, its output in ``log_path``."""
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [CELERY, "-A", "kiln.celery_app", "worker", "--pool", "solo", "--loglevel", "INFO",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_webhook_task_enqueued_with_delay_is_retried_and_delivered_by_a_real_worker(
        db: Any, ctx: Context, redis_prefix: str, tmp_path: Path) -> None:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    env = {**os.environ, "KILN_ENVIRONMENT": "local",  # the receiver listens on 127.0.0.1
           "KILN_DATABASE_URL": db.url, "REDIS_URL": str(settings.redis_url),
           "KILN_REDIS_PREFIX": redis_prefix,
           "KILN_OUTPUT_DIR": str(settings.output_dir), "KILN_WEBHOOK_BACKOFF_SECONDS": "0.5"}
    log_path = tmp_path / "celery.log"
    with Receiver(fail_first=1) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, now=utcnow(), webhook_url=receiver.url).id
            succeed(ctx, s, job_id, now=utcnow())
        with celery_worker(env, log_path), tasks.make_celery(settings) as app:
            result = app.tasks["kiln.deliver_webhook"].delay(job_id)
            outcome = result.get(timeout=60)
            got = receiver.wait_for(2)
    # The first POST got a 500; Celery carried the retry; the result is the final attempt's.
    assert outcome == {"state": "delivered", "attempt": 2, "status": 200}, log_path.read_text()
    assert [(r.answered, r.headers["Kiln-Attempt"]) for r in got] == [(500, "1"), (200, "2")]
    assert {r.headers["Kiln-Delivery"] for r in got} == {job_id}
    # Signed in the worker process with the owner's secret, made there on first need.
    for r in got:
        assert Webhook(secret_of(ctx)).verify(r.body, r.headers)["data"]["id"] == job_id
    with ctx.sessions() as s:
        row = webhooks.delivery(s, job_id)
        assert row is not None and row.state == "delivered"


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_progress_event_is_tried_webhook_max_attempts_times_by_a_real_worker(
        db: Any, ctx: Context, redis_prefix: str, tmp_path: Path) -> None:
    settings = make_settings(db.url, redis_prefix, tmp_path, webhook_max_attempts=8,
                             webhook_backoff_seconds=0.05, webhook_backoff_max_seconds=0.2)
    env = {**os.environ, "KILN_ENVIRONMENT": "local", "KILN_DATABASE_URL": db.url,
           "REDIS_URL": str(settings.redis_url), "KILN_REDIS_PREFIX": redis_prefix,
           "KILN_OUTPUT_DIR": str(settings.output_dir), "KILN_WEBHOOK_MAX_ATTEMPTS": "8",
           "KILN_WEBHOOK_BACKOFF_SECONDS": "0.05", "KILN_WEBHOOK_BACKOFF_MAX_SECONDS": "0.2"}
    log_path = tmp_path / "celery.log"
    with Receiver(fail_first=100, fail_status=503) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, now=utcnow(), webhook_url=receiver.url).id
        msg_id, body = tasks.progress_event(job_id, 1, 2, 4)
        with celery_worker(env, log_path), tasks.make_celery(settings) as app:
            app.tasks["kiln.deliver_event"].delay(receiver.url, msg_id, "job.progress",
                                                  body.decode())
            got = receiver.wait_for(8)
            time.sleep(1.5)  # a ninth attempt would be due 0.2 s after the eighth
    assert [r.headers["Kiln-Attempt"] for r in receiver.requests] == [
        str(n) for n in range(1, 9)], log_path.read_text()
    assert {r.headers["webhook-id"] for r in got} == {msg_id}
    with ctx.sessions() as s:
        attempts = webhooks.delivery_log(s, job_id).attempts
        assert sorted(a.outcome for a in attempts) == ["failed"] + ["retrying"] * 7
