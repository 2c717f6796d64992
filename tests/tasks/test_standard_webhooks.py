"""Webhooks by the Standard Webhooks convention: every request verifies with the
``standardwebhooks`` library under its owner's secret, a job's events arrive in order (started,
progress..., succeeded), failed POSTs are retried (a live event's retries through a row of its
own that the sweep finds once due), and the job's event filter drops what it did not ask for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from servers import Receiver
from standardwebhooks import Webhook, WebhookVerificationError
from task_helpers import fail, secret_of, submit

from api.schemas import JobCreate
from kiln import group_io
from kiln.coordinator import Coordinator
from kiln.tasks import (
    Context,
    deliver,
    deliver_live,
    deliver_logged,
    progress_event,
    redeliver_live,
    started_event,
    sweep,
    sweep_live,
)
from kiln.worker import WorkerConfig, make_coordinator
from runtime.rank_loop import Ended, Progress
from runtime.sequence import Layout
from storage import lifecycle, webhooks
from storage.outputs import video_key
from storage.tables import LiveWebhookRetry, utcnow


def verified(ctx: Context, received: Any) -> dict[str, Any]:
    """The event, verified with alice's secret (every job here is hers)."""
    return Webhook(secret_of(ctx)).verify(received.body, received.headers)  # type: ignore[no-any-return]


@pytest.fixture
def coordinator(ctx: Context) -> Iterator[Coordinator]:
    def send_now(url: str, msg_id: str, kind: str, body: bytes) -> None:
        # What the kiln.deliver_event task does, run here and now.
        assert deliver_live(ctx, url, msg_id, kind, body).state == "delivered"

    c = make_coordinator(ctx.settings, WorkerConfig(), Layout(), "cpu",
                         notify=lambda session, job_id: None, send_event=send_now)
    yield c
    c.io.close()


def run_job(ctx: Context, c: Coordinator, job_id: str, steps: int) -> None:
    """The job's transitions the way the worker group makes them: claim, a heartbeat per step,
    the final one; then the final event's delivery."""
    with ctx.sessions() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id=c.group_id, rank=0,
                                    lease_seconds=600)
        assert claim is not None
        c.attempt_numbers[claim.attempt_token] = claim.job.attempts
        c.io.started(claim.job)
    for step in range(1, steps + 1):
        c.record([Progress(rank=0, job_id=job_id, attempt_token=claim.attempt_token,
                           step=step, num_inference_steps=steps)])
    c.record([Ended(rank=0, job_id=job_id, attempt_token=claim.attempt_token, step=steps,
                    num_inference_steps=steps, outcome="succeeded", video_key=video_key(job_id))])
    deliver(ctx, job_id)


def test_a_job_gets_its_events_in_order_each_verified_by_the_library(
        ctx: Context, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_io, "PROGRESS_EVERY_SECONDS", 0.0)
    with Receiver() as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, webhook_url=receiver.url, num_inference_steps=3,
                            webhook_events=["job.started", "job.progress", "job.succeeded"]).id
        run_job(ctx, coordinator, job_id, steps=3)
        got = receiver.wait_for(5)
    events = [verified(ctx, r) for r in got]
    assert [e["type"] for e in events] == [
        "job.started", "job.progress", "job.progress", "job.progress", "job.succeeded"]
    assert [e["data"]["step"] for e in events[1:4]] == [1, 2, 3]
    assert {e["data"]["id"] for e in events} == {job_id}
    assert events[-1]["data"]["status"] == "succeeded"
    assert events[-1]["data"]["video_url"] == f"/v1/jobs/{job_id}/video"
    assert len({r.headers["webhook-id"] for r in got}) == 5  # one id per event
    for r in got:
        assert r.headers["webhook-signature"].startswith("v1,")
        assert int(r.headers["webhook-timestamp"]) == pytest.approx(utcnow().timestamp(), abs=30)
        assert json.loads(r.body)["timestamp"]
        with pytest.raises(WebhookVerificationError):
            Webhook(secret_of(ctx, "bob")).verify(r.body, r.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(secret_of(ctx)).verify(r.body + b" ", r.headers)


def test_progress_is_sent_at_most_every_two_seconds_per_job(
        ctx: Context, coordinator: Coordinator) -> None:
    with Receiver() as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, webhook_url=receiver.url, num_inference_steps=4,
                            webhook_events=["job.progress", "job.succeeded"]).id
        run_job(ctx, coordinator, job_id, steps=4)  # four steps well within 2 s
        got = receiver.wait_for(2)
    assert [verified(ctx, r)["type"] for r in got] == ["job.progress", "job.succeeded"]


def test_a_receiver_answering_500_twice_gets_the_event_on_the_third_try(ctx: Context) -> None:
    with Receiver(fail_first=2) as receiver:
        with ctx.sessions() as s:
            live_id = submit(s, webhook_url=receiver.url).id
        msg_id, body = progress_event(live_id, 1, 2, 4)
        outcomes = [deliver_live(ctx, receiver.url, msg_id, "job.progress", body, attempt=n)
                    for n in (1, 2, 3)]
        assert [(o.state, o.status) for o in outcomes] == [
            ("pending", 500), ("pending", 500), ("delivered", 200)]
        # Waits of 2 s then 4 s, each jittered over its upper half (common.retry).
        waits = [o.retry_in for o in outcomes]
        assert waits[0] is not None and waits[1] is not None and waits[2] is None
        assert 1.0 <= waits[0] <= 2.0 and 2.0 <= waits[1] <= 4.0
        # The final events: the outbox's retries, with the same webhook-id on every attempt.
        receiver.fail_first = 5  # counted from the first request: two more 500s
        t = utcnow() - timedelta(minutes=1)
        with ctx.sessions() as s:
            job_id = submit(s, now=t, webhook_url=receiver.url).id
            fail(s, job_id, now=t)
        states = [deliver(ctx, job_id, now=t + timedelta(seconds=10 * i)).state
                  for i in range(3)]
        assert states == ["pending", "pending", "delivered"]
    got = receiver.requests
    assert [r.answered for r in got] == [500, 500, 200, 500, 500, 200]
    assert len({r.headers["webhook-id"] for r in got[:3]}) == 1
    assert len({r.headers["webhook-id"] for r in got[3:]}) == 1
    assert verified(ctx, got[2])["data"]["step"] == 2
    final = verified(ctx, got[-1])
    assert (final["type"], final["data"]["id"]) == ("job.failed", job_id)


def _live_row(ctx: Context, msg_id: str) -> LiveWebhookRetry | None:
    with ctx.sessions() as s:
        return s.get(LiveWebhookRetry, msg_id)


def test_a_failed_live_event_is_held_in_the_outbox_and_sent_by_the_sweep_once_due(
        ctx: Context) -> None:
    with Receiver(fail_first=2) as receiver:
        with ctx.sessions() as s:
            job = submit(s, webhook_url=receiver.url, webhook_events=["job.started"])
            job_id, (msg_id, body) = job.id, started_event(job)
        t = utcnow()
        # The worker group's task: the first attempt, then the row holds the retry.
        assert deliver_logged(ctx, receiver.url, msg_id, "job.started", body, now=t).state == (
            "pending")
        row = _live_row(ctx, msg_id)
        assert row is not None and (row.job_id, row.attempts, row.body) == (
            job_id, 1, body.decode())
        assert t + timedelta(seconds=1) <= row.next_attempt_at <= t + timedelta(seconds=3)
        due = row.next_attempt_at
        assert sweep_live(ctx, now=due - timedelta(seconds=0.1)) == []
        assert sweep_live(ctx, now=due) == [(job_id, msg_id)]
        # Not due yet, a retry sends nothing; due, the sweep's retries go out until delivered.
        assert redeliver_live(ctx, msg_id, now=due - timedelta(seconds=0.1)).state == "skipped"
        second = redeliver_live(ctx, msg_id, now=due)
        assert (second.state, second.attempt, second.status) == ("pending", 2, 500)
        row = _live_row(ctx, msg_id)
        assert row is not None and row.attempts == 2 and row.next_attempt_at > due
        third = redeliver_live(ctx, msg_id, now=row.next_attempt_at)
        assert (third.state, third.attempt, third.status) == ("delivered", 3, 200)
        assert _live_row(ctx, msg_id) is None
        assert sweep_live(ctx, now=utcnow() + timedelta(hours=1)) == []
    got = receiver.requests
    assert [(r.answered, r.headers["Kiln-Attempt"]) for r in got] == [
        (500, "1"), (500, "2"), (200, "3")]
    assert {r.headers["webhook-id"] for r in got} == {msg_id}
    assert {r.body for r in got} == {body}
    assert verified(ctx, got[-1])["type"] == "job.started"
    with ctx.sessions() as s:
        log = webhooks.delivery_log(s, job_id)
        assert [(a.attempt, a.outcome) for a in log.attempts] == [
            (3, "delivered"), (2, "retrying"), (1, "retrying")]


def test_a_live_event_is_given_up_after_max_attempts_and_leaves_no_row(ctx: Context) -> None:
    with Receiver(fail_first=100, fail_status=503) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, webhook_url=receiver.url).id
        msg_id, body = progress_event(job_id, 1, 2, 4)
        assert deliver_logged(ctx, receiver.url, msg_id, "job.progress", body).state == "pending"
        clock, states = utcnow(), []
        while owed := sweep_live(ctx, now=(clock := clock + timedelta(minutes=5))):
            assert owed == [(job_id, msg_id)]
            states.append(redeliver_live(ctx, msg_id, now=clock).state)
        assert states == ["pending", "failed"]  # webhook_max_attempts: 3
    assert len(receiver.requests) == 3
    assert _live_row(ctx, msg_id) is None


def test_the_filter_drops_the_events_not_asked_for(
        ctx: Context, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_io, "PROGRESS_EVERY_SECONDS", 0.0)
    with Receiver() as receiver:
        with ctx.sessions() as s:
            wanted = submit(s, webhook_url=receiver.url, webhook_events=["job.succeeded"]).id
            unwanted = submit(s, now=utcnow() - timedelta(minutes=5), webhook_url=receiver.url,
                              webhook_events=["job.succeeded"]).id
            claim = lifecycle.claim_job(s, unwanted, worker_group_id="g", rank=0,
                                        lease_seconds=60)
            assert claim is not None
            assert lifecycle.fail_job(s, unwanted, claim.attempt_token, error="no") is not None
        run_job(ctx, coordinator, wanted, steps=3)
        assert deliver(ctx, unwanted).state == webhooks.UNWANTED
        assert sweep(ctx, now=utcnow() + timedelta(minutes=1)) == []  # it owes nothing
        got = receiver.wait_for(1)
    assert [(verified(ctx, r)["type"], verified(ctx, r)["data"]["id"]) for r in got] == [
        ("job.succeeded", wanted)]
    with ctx.sessions() as s:
        row = webhooks.delivery(s, unwanted)
        assert row is not None and row.state == webhooks.UNWANTED


def test_an_unknown_event_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        JobCreate.model_validate({"prompt": "p", "webhook_events": ["job.started", "job.bogus"]})
    assert [e["loc"] for e in caught.value.errors()] == [("webhook_events", 1)]
    assert JobCreate.model_validate({"prompt": "p"}).webhook_events is None
