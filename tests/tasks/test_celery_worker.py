"""A real Celery worker process on kiln's Redis (under a prefix of its own), with its beat
embedded, runs a task that was enqueued with ``.delay`` from another process; a failed POST ends
the task, and the beat's webhook sweep sends the retry once its outbox row is due, a live event's
too, as many times as webhook_max_attempts allows."""

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
from storage.tables import LiveWebhookRetry, utcnow

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


def worker_env(db_url: str, redis_prefix: str, tmp_path: Path, **settings: str) -> dict[str, str]:
    """The environment of a worker on the test's database and Redis prefix, its beat sweeping
    the webhooks every 0.3 s."""
    (tmp_path / "data").mkdir(exist_ok=True)
    env = {**os.environ, "KILN_ENVIRONMENT": "local",  # the receiver listens on 127.0.0.1
           "KILN_DATABASE_URL": db_url, "REDIS_URL": "redis://127.0.0.1:6379/0",
           "KILN_REDIS_PREFIX": redis_prefix, "KILN_OUTPUT_DIR": str(tmp_path / "outputs"),
           "KILN_DATA_DIR": str(tmp_path / "data"), "KILN_WEBHOOK_SWEEP_INTERVAL_SECONDS": "0.3"}
    env.update({f"KILN_{name.upper()}": value for name, value in settings.items()})
    return env


@contextlib.contextmanager
def celery_worker(env: dict[str, str], log_path: Path) -> Iterator[None]:
    """``celery worker`` (one process, no pool) with its beat embedded and ``env``, its output in
    ``log_path``."""
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [CELERY, "-A", "kiln.celery_app", "worker", "--pool", "solo", "--beat",
             "--loglevel", "INFO", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
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


def _wait_until(check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_webhook_task_enqueued_with_delay_fails_once_and_the_sweep_sends_its_retry(
        db: Any, ctx: Context, redis_prefix: str, tmp_path: Path) -> None:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    env = worker_env(db.url, redis_prefix, tmp_path, webhook_backoff_seconds="0.5")
    log_path = tmp_path / "celery.log"
    with Receiver(fail_first=1) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, now=utcnow(), webhook_url=receiver.url).id
            succeed(ctx, s, job_id, now=utcnow())
        with celery_worker(env, log_path), tasks.make_celery(settings) as app:
            result = app.tasks["kiln.deliver_webhook"].delay(job_id)
            outcome = result.get(timeout=60)
            got = receiver.wait_for(2)

            def delivered() -> bool:
                with ctx.sessions() as s:
                    row = webhooks.delivery(s, job_id)
                    return row is not None and row.state == "delivered"

            _wait_until(delivered)
    # The task made one attempt, got a 500 and ended; the sweep sent the retry.
    assert outcome == {"state": "pending", "attempt": 1, "status": 500}, log_path.read_text()
    assert [(r.answered, r.headers["Kiln-Attempt"]) for r in got] == [(500, "1"), (200, "2")]
    assert {r.headers["Kiln-Delivery"] for r in got} == {job_id}
    # Signed in the worker process with the owner's secret, made there on first need.
    for r in got:
        assert Webhook(secret_of(ctx)).verify(r.body, r.headers)["data"]["id"] == job_id
    assert "Task kiln.sweep_webhooks" in log_path.read_text()


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_progress_event_is_tried_webhook_max_attempts_times_by_a_real_worker(
        db: Any, ctx: Context, redis_prefix: str, tmp_path: Path) -> None:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    env = worker_env(db.url, redis_prefix, tmp_path, webhook_max_attempts="8",
                     webhook_backoff_seconds="0.05", webhook_backoff_max_seconds="0.2")
    log_path = tmp_path / "celery.log"
    with Receiver(fail_first=100, fail_status=503) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, now=utcnow(), webhook_url=receiver.url).id
        msg_id, body = tasks.progress_event(job_id, 1, 2, 4)
        with celery_worker(env, log_path), tasks.make_celery(settings) as app:
            app.tasks["kiln.deliver_event"].delay(receiver.url, msg_id, "job.progress",
                                                  body.decode())
            got = receiver.wait_for(8, timeout=60)

            def given_up() -> bool:
                with ctx.sessions() as s:
                    return webhooks.delivery_log(s, job_id).num_attempts == 8

            _wait_until(given_up)
            time.sleep(1.5)  # a ninth attempt would be due 0.2 s after the eighth, swept 0.3 s on
    assert [r.headers["Kiln-Attempt"] for r in receiver.requests] == [
        str(n) for n in range(1, 9)], log_path.read_text()
    assert {r.headers["webhook-id"] for r in got} == {msg_id}
    with ctx.sessions() as s:
        attempts = webhooks.delivery_log(s, job_id).attempts
        assert sorted(a.outcome for a in attempts) == ["failed"] + ["retrying"] * 7
        assert s.get(LiveWebhookRetry, msg_id) is None  # given up: the outbox holds nothing
