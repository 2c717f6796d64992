"""batch.completed: sent once a batch's last job has ended, with its report, signed the Standard
Webhooks way (verified here with the ``standardwebhooks`` library), retried with the same
``webhook-id`` by the sweep once each retry is due, exactly once when jobs end together, and made
good by the sweep when its task is lost; and every attempt at any webhook event lands in the
delivery log."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from servers import Receiver
from sqlalchemy import select, update
from sqlalchemy.orm import Session
from standardwebhooks import Webhook, WebhookVerificationError
from task_helpers import fail, make_settings, secret_of, submit, succeed, user

from api import batches as batch_views
from api.batches import Submission, specs_from_submission
from api.schemas import BatchCreate
from kiln.tasks import (
    Context,
    batch_event_id,
    deliver,
    deliver_batch,
    deliver_logged,
    reap_leases,
    started_event,
    sweep_batches,
)
from storage import batches, lifecycle, webhooks
from storage.submission import JobSpec
from storage.tables import Batch, Job, WebhookAttempt, utcnow


def _spec(i: int, **fields: Any) -> JobSpec:
    return JobSpec(model="kiln-tiny", prompt=f"prompt {i}", width=64, height=64, num_frames=9,
                   fps=8, num_inference_steps=4, guidance_scale=5.0, seed=i, job_class="batch",
                   **fields)


def _batch(session: Session, url: str, num_jobs: int, **options: Any) -> tuple[str, list[str]]:
    made = batches.create_batch(session, user(session), [_spec(i) for i in range(num_jobs)],
                                name="night", metadata={"project": "teaser"}, webhook_url=url,
                                request_hash="h", **options)
    return made.batch.id, [j.id for j in made.jobs]


def _log(ctx: Context, batch_id: str) -> list[tuple[int, str, int | None]]:
    with ctx.sessions() as s:
        rows = s.scalars(select(WebhookAttempt).where(WebhookAttempt.batch_id == batch_id)
                         .order_by(WebhookAttempt.id))
        return [(r.attempt, r.outcome, r.status) for r in rows]


def test_the_last_job_to_end_sends_one_signed_batch_completed_with_the_report(
        ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=30)
    with Receiver() as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 3)
            succeed(ctx, s, jobs[0], now=t)
            fail(s, jobs[1], now=t + timedelta(minutes=10))
        assert deliver_batch(ctx, batch_id).state == "skipped"  # one job is still queued
        with ctx.sessions() as s:
            succeed(ctx, s, jobs[2], now=t + timedelta(minutes=20))
        outcome = deliver_batch(ctx, batch_id)
        assert (outcome.state, outcome.attempt, outcome.status) == ("delivered", 1, 200)
        assert deliver_batch(ctx, batch_id).state == "skipped"  # sent: nothing more is owed
        assert sweep_batches(ctx, now=utcnow() + timedelta(minutes=5)) == []
        got = receiver.wait_for(1)
    assert len(got) == 1
    # Signed with the batch owner's own secret.
    sent = Webhook(secret_of(ctx, "alice")).verify(got[0].body, got[0].headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret_of(ctx, "bob")).verify(got[0].body, got[0].headers)
    assert got[0].headers["webhook-id"] == batch_event_id(batch_id)
    assert sent["type"] == "batch.completed"
    data = sent["data"]
    # The worker builds the report below the API, and sends what GET .../report shows.
    with ctx.sessions() as s:
        shown = batch_views.report(s, s.get(Batch, batch_id)).model_dump(  # type: ignore[arg-type]
            mode="json", exclude={"object", "jobs"})
    assert {k: data[k] for k in shown} == shown
    assert (data["id"], data["name"], data["num_jobs"]) == (batch_id, "night", 3)
    assert {k: v for k, v in data["counts"].items() if v} == {"succeeded": 2, "failed": 1}
    assert data["active_seconds"] == 1200.0  # from the first start to the last finish
    assert data["videos_per_hour"] == 6.0
    assert [(p["id"], p["error"]["message"]) for p in data["problems"]] == [
        (jobs[1], "the prompt was refused")]
    assert "jobs" not in data and data["report_url"] == f"/v1/batches/{batch_id}/report"
    assert data["metadata"] == {"project": "teaser"}
    assert datetime.fromisoformat(sent["timestamp"]) == datetime.fromisoformat(
        data["finished_at"]) == t + timedelta(minutes=20)
    assert _log(ctx, batch_id) == [(1, "delivered", 200)]
    with ctx.sessions() as s:
        assert s.get(Batch, batch_id).webhook_state == webhooks.DELIVERED  # type: ignore[union-attr]


def test_two_jobs_ending_at_the_same_moment_send_one_event(ctx: Context) -> None:
    with Receiver() as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 2)
            tokens = {}
            for job_id in jobs:
                claim = lifecycle.claim_job(s, job_id, worker_group_id="g", rank=0,
                                            lease_seconds=60)
                assert claim is not None
                tokens[job_id] = claim.attempt_token
        start = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def end(job_id: str) -> None:
            # What each worker group does: its job's final state, then the batch's task.
            with ctx.sessions() as s:
                start.wait()
                assert lifecycle.fail_job(s, job_id, tokens[job_id], error="no") is not None
            outcomes[job_id] = deliver_batch(ctx, batch_id).state

        threads = [threading.Thread(target=end, args=(j,)) for j in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        receiver.wait_for(1)
        assert sorted(outcomes.values()) == ["delivered", "skipped"]
        assert sweep_batches(ctx, now=utcnow() + timedelta(minutes=5)) == []
    assert len(receiver.requests) == 1
    assert _log(ctx, batch_id) == [(1, "delivered", 200)]


def test_many_tasks_for_one_completed_batch_post_it_once(ctx: Context) -> None:
    with Receiver() as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 1)
            fail(s, jobs[0], now=utcnow())
        start = threading.Barrier(4)
        states: list[str] = []

        def task() -> None:
            start.wait()
            states.append(deliver_batch(ctx, batch_id).state)

        threads = [threading.Thread(target=task) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(states) == ["delivered", "skipped", "skipped", "skipped"]
    assert len(receiver.requests) == 1


def test_a_receiver_failing_twice_gets_it_on_the_third_try_with_the_same_id(
        ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with Receiver(fail_first=2) as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 1)
            succeed(ctx, s, jobs[0], now=t)
        outcomes = [deliver_batch(ctx, batch_id, now=t + timedelta(seconds=10 * i))
                    for i in range(3)]
    assert [(o.state, o.status) for o in outcomes] == [
        ("pending", 500), ("pending", 500), ("delivered", 200)]
    # Waits of 2 s then 4 s, each jittered over its upper half (common.retry).
    waits = [o.retry_in for o in outcomes]
    assert waits[0] is not None and waits[1] is not None and waits[2] is None
    assert 1.0 <= waits[0] <= 2.0 and 2.0 <= waits[1] <= 4.0
    got = receiver.requests
    assert [r.answered for r in got] == [500, 500, 200]
    assert {r.headers["webhook-id"] for r in got} == {batch_event_id(batch_id)}
    assert [r.headers["Kiln-Attempt"] for r in got] == ["1", "2", "3"]
    for r in got:
        assert Webhook(secret_of(ctx)).verify(r.body, r.headers)["data"]["id"] == batch_id
    assert _log(ctx, batch_id) == [(1, "retrying", 500), (2, "retrying", 500),
                                   (3, "delivered", 200)]


def test_a_due_retry_is_sent_by_the_sweep_within_the_grace(ctx: Context) -> None:
    t = utcnow()
    with Receiver(fail_first=1) as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 1)
            succeed(ctx, s, jobs[0], now=t)
        first = deliver_batch(ctx, batch_id, now=t)
        assert (first.state, first.status) == ("pending", 500)
        with ctx.sessions() as s:
            batch = s.get(Batch, batch_id)
            assert batch is not None and batch.webhook_next_attempt_at is not None
            retry_at = batch.webhook_next_attempt_at
        # Seconds after the batch ended, well within the grace: the retry is the sweep's own.
        assert sweep_batches(ctx, now=retry_at - timedelta(seconds=0.1)) == []
        assert sweep_batches(ctx, now=retry_at) == [batch_id]
        assert deliver_batch(ctx, batch_id, now=retry_at).state == "delivered"
        assert sweep_batches(ctx, now=retry_at + timedelta(hours=1)) == []
    assert [r.answered for r in receiver.requests] == [500, 200]
    assert _log(ctx, batch_id) == [(1, "retrying", 500), (2, "delivered", 200)]


def test_a_lost_task_is_made_good_by_the_sweep_after_its_grace(ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=2)
    with Receiver() as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 2)
            succeed(ctx, s, jobs[0], now=t)
            # Its last job ends by the reaper (its deadline passed), and no task runs.
            s.execute(update(Job).where(Job.id == jobs[1])
                      .values(deadline=utcnow() - timedelta(seconds=1)))
            s.commit()
        reaped = reap_leases(ctx)
        assert reaped.expired == [jobs[1]] and reaped.batches == [batch_id]
        # Within the grace, the enqueued task is left to do it; after it, the sweep owes it.
        assert sweep_batches(ctx) == []
        assert sweep_batches(ctx, now=utcnow() + timedelta(minutes=1)) == [batch_id]
        assert deliver_batch(ctx, batch_id).state == "delivered"
        assert sweep_batches(ctx, now=utcnow() + timedelta(minutes=1)) == []
        got = receiver.wait_for(1)
    data = Webhook(secret_of(ctx)).verify(got[0].body, got[0].headers)["data"]
    assert {k: v for k, v in data["counts"].items() if v} == {"succeeded": 1, "expired": 1}


def test_the_filter_drops_it_and_unknown_events_or_private_addresses_are_refused(
        ctx: Context, tmp_path: Any) -> None:
    with Receiver() as receiver:
        with ctx.sessions() as s:
            batch_id, jobs = _batch(s, receiver.url, 1, webhook_events=[])
            fail(s, jobs[0], now=utcnow())
        assert deliver_batch(ctx, batch_id).state == webhooks.UNWANTED
        assert sweep_batches(ctx, now=utcnow() + timedelta(minutes=5)) == []
    assert receiver.requests == []
    body = {"jobs": [{"prompt": "p"}], "webhook_url": "https://hooks.example.com/kiln"}
    with pytest.raises(ValidationError) as caught:
        BatchCreate.model_validate({**body, "webhook_events": ["job.succeeded"]})
    assert [e["loc"] for e in caught.value.errors()] == [("webhook_events", 0)]
    assert BatchCreate.model_validate(body).webhook_events is None
    strict = make_settings(ctx.settings.database_url, "p:", tmp_path, webhook_allow_private=False)
    private = BatchCreate.model_validate({**body, "webhook_url": "http://10.0.0.7/hook"})
    with pytest.raises(RequestValidationError) as refused:
        specs_from_submission(Submission(private, [1]), strict, utcnow())
    assert [e["loc"] for e in refused.value.errors()] == [("body", "webhook_url")]


def test_every_attempt_at_a_jobs_events_goes_into_its_delivery_log(ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with Receiver(fail_first=1) as receiver:
        with ctx.sessions() as s:
            job = submit(s, now=t, webhook_url=receiver.url,
                         webhook_events=["job.started", "job.failed"])
            job_id = job.id
            msg_id, body = started_event(job)
            fail(s, job_id, now=t)
        assert deliver_logged(ctx, receiver.url, msg_id, "job.started", body).state == "pending"
        assert deliver(ctx, job_id, now=t + timedelta(seconds=5)).state == "delivered"
    with ctx.sessions() as s:
        log = webhooks.delivery_log(s, job_id)
        assert [(a.event, a.attempt, a.status, a.outcome) for a in log.attempts] == [
            ("job.failed", 1, 200, "delivered"), ("job.started", 1, 500, "retrying")]
        assert log.attempts[1].error == "the receiver answered HTTP 500"
        assert log.num_attempts == 2
        assert log.final is not None and log.final.state == webhooks.DELIVERED
