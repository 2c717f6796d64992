"""Webhook delivery against a real HTTP receiver: signature, retries with backoff, giving up, and
the sweeper that sends each retry once due and finds deliveries whose task was lost (the job row
is the outbox)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from servers import Receiver
from standardwebhooks import Webhook, WebhookVerificationError
from task_helpers import SECRET, fail, make_settings, secret_of, submit, succeed, user

from common import netguard
from common.procs import free_port
from kiln import signing, tasks
from kiln.tasks import Context, deliver, sweep
from storage import lifecycle, webhooks
from storage.tables import utcnow


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver(fail_first=2) as r:
        yield r


def test_failed_posts_are_retried_with_doubling_backoff_until_a_signed_delivery_succeeds(
        ctx: Context, receiver: Receiver) -> None:
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url, metadata={"ref": "42"}).id
        succeed(ctx, s, job_id, now=t, has_audio=True)

    first = deliver(ctx, job_id, now=t)
    # The waits double from webhook_backoff_seconds (2 s), each jittered over its upper half.
    assert (first.state, first.attempt, first.status) == ("pending", 1, 500)
    assert first.retry_in is not None and 1.0 <= first.retry_in <= 2.0
    # Before the backoff has passed nothing is sent.
    assert deliver(ctx, job_id, now=t + timedelta(seconds=0.5)).state == "skipped"
    second = deliver(ctx, job_id, now=t + timedelta(seconds=3))
    assert (second.state, second.attempt) == ("pending", 2)
    assert second.retry_in is not None and 2.0 <= second.retry_in <= 4.0
    third = deliver(ctx, job_id, now=t + timedelta(seconds=10))
    assert (third.state, third.attempt, third.status) == ("delivered", 3, 200)
    # Delivered once is delivered for good.
    assert deliver(ctx, job_id, now=t + timedelta(minutes=5)).state == "skipped"

    got = receiver.requests
    assert [r.answered for r in got] == [500, 500, 200]
    assert [r.headers["Kiln-Attempt"] for r in got] == ["1", "2", "3"]
    assert {r.headers["Kiln-Delivery"] for r in got} == {job_id}
    assert {r.headers["Kiln-Event"] for r in got} == {"job.succeeded"}
    for r in got:
        assert r.path == "/hook" and r.headers["Content-Type"] == "application/json"
        Webhook(secret_of(ctx, "alice")).verify(r.body, r.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(secret_of(ctx, "bob")).verify(r.body, r.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(secret_of(ctx, "alice")).verify(r.body + b" ", r.headers)
    body = json.loads(got[-1].body)
    assert body["type"] == "job.succeeded"
    assert body["data"]["id"] == job_id and body["data"]["status"] == "succeeded"
    assert body["data"]["video_url"] == f"/v1/jobs/{job_id}/video"
    assert body["data"]["has_audio"] is True  # the video has a soundtrack
    assert body["data"]["metadata"] == {"ref": "42"} and body["data"]["error"] is None
    with ctx.sessions() as s:
        row = webhooks.delivery(s, job_id)
        assert row is not None
        assert (row.state, row.attempts, row.last_status, row.last_error) == (
            "delivered", 3, 200, None)


def test_delivery_gives_up_after_max_attempts_and_records_why(ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with Receiver(fail_first=100, fail_status=503) as receiver, ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url).id
        fail(s, job_id, now=t)
        outcomes = [deliver(ctx, job_id, now=t + timedelta(minutes=i)).state for i in range(5)]
        assert outcomes == ["pending", "pending", "failed", "skipped", "skipped"]
        assert len(receiver.requests) == 3  # webhook_max_attempts
        body = json.loads(receiver.requests[0].body)
        assert body["type"] == "job.failed"
        assert body["data"]["error"] == {"code": "bad_prompt", "message": "the prompt was refused"}
        row = webhooks.delivery(s, job_id)
        assert row is not None
        assert (row.state, row.attempts, row.last_status) == ("failed", 3, 503)
        assert row.last_error == "the receiver answered HTTP 503"


def test_410_gone_stops_retrying_at_once(ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with Receiver(fail_first=1, fail_status=410) as receiver, ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url).id
        succeed(ctx, s, job_id, now=t)
        out = deliver(ctx, job_id, now=t)
        assert (out.state, out.attempt, out.status, out.retry_in) == ("failed", 1, 410, None)
        assert deliver(ctx, job_id, now=t + timedelta(hours=1)).state == "skipped"
        assert len(receiver.requests) == 1


def test_an_unreachable_receiver_is_a_failed_attempt_that_is_retried(ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=f"http://127.0.0.1:{free_port()}/nobody").id
        succeed(ctx, s, job_id, now=t)
        out = deliver(ctx, job_id, now=t)
        assert (out.state, out.status) == ("pending", None)
        assert out.retry_in is not None and 1.0 <= out.retry_in <= 2.0
        row = webhooks.delivery(s, job_id)
        assert row is not None and row.last_error is not None
        assert row.last_error.startswith("ConnectError")


def test_a_deployment_secret_adds_its_signature_after_the_owners(
        redis_prefix: str, tmp_path: object, ctx: Context, receiver: Receiver) -> None:
    ctx.settings = make_settings(ctx.settings.database_url, redis_prefix, tmp_path,  # type: ignore[arg-type]
                                 webhook_secret=SECRET)
    receiver.fail_first = 0
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url).id
        succeed(ctx, s, job_id, now=t)
    assert deliver(ctx, job_id, now=t).state == "delivered"
    r = receiver.requests[0]
    signatures = r.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(sig.startswith("v1,") for sig in signatures)
    for secret in (secret_of(ctx, "alice"), signing.standard_secret(SECRET)):
        assert Webhook(secret).verify(r.body, r.headers)["data"]["id"] == job_id
    # The owner's alone is the first signature.
    own = dict(r.headers, **{"webhook-signature": signatures[0]})
    Webhook(secret_of(ctx, "alice")).verify(r.body, own)
    assert "Kiln-Signature" not in r.headers


def test_an_attempt_in_flight_blocks_a_second_one_until_its_hold_runs_out(
        ctx: Context, receiver: Receiver) -> None:
    t = utcnow() - timedelta(minutes=10)
    receiver.fail_first = 0
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url).id
        succeed(ctx, s, job_id, now=t)
        # A task takes the attempt and its process dies before posting.
        assert webhooks.begin_attempt(s, job_id, hold_seconds=45, now=t) is not None
    assert deliver(ctx, job_id, now=t + timedelta(seconds=10)).state == "skipped"
    assert receiver.requests == []
    out = deliver(ctx, job_id, now=t + timedelta(seconds=50))
    assert (out.state, out.attempt) == ("delivered", 2)
    assert len(receiver.requests) == 1


def test_the_sweeper_finds_owed_webhooks_from_the_database_alone(
        ctx: Context, receiver: Receiver) -> None:
    now = utcnow()
    recent = now - timedelta(minutes=5)
    url = receiver.url
    with ctx.sessions() as s:
        never_sent = submit(s, now=recent, webhook_url=url).id
        succeed(ctx, s, never_sent, now=recent)
        failed_job = submit(s, now=recent, webhook_url=url).id
        fail(s, failed_job, now=recent)
        no_hook = submit(s, now=recent).id
        succeed(ctx, s, no_hook, now=recent)
        still_queued = submit(s, now=recent, webhook_url=url).id
        too_old = submit(s, now=now - timedelta(days=2), webhook_url=url).id
        succeed(ctx, s, too_old, now=now - timedelta(days=2))
        just_finished = submit(s, now=now, webhook_url=url).id
        succeed(ctx, s, just_finished, now=now)  # its own task is on its way: leave it
        delivered = submit(s, now=recent, webhook_url=url).id
        succeed(ctx, s, delivered, now=recent)
        in_flight = submit(s, now=recent, webhook_url=url).id
        succeed(ctx, s, in_flight, now=recent)
        cancelled = submit(s, now=recent, webhook_url=url).id
        assert lifecycle.request_cancel(s, cancelled, user(s), now=recent) is not None
    receiver.fail_first = 0
    assert deliver(ctx, delivered, now=recent).state == "delivered"
    with ctx.sessions() as s:
        assert webhooks.begin_attempt(s, in_flight, hold_seconds=3600, now=now) is not None

    owed = sweep(ctx, now=now)
    assert sorted(owed) == sorted([never_sent, failed_job, cancelled])
    assert still_queued not in owed and too_old not in owed and no_hook not in owed
    # Once the sweep's deliveries went out, nothing is owed any more.
    for job_id in owed:
        assert deliver(ctx, job_id, now=now).state == "delivered"
    assert sweep(ctx, now=now) == []


def test_a_retry_is_sent_by_the_sweep_once_due_until_max_attempts_give_up(
        ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=10)
    with Receiver(fail_first=100, fail_status=503) as receiver:
        with ctx.sessions() as s:
            job_id = submit(s, now=t, webhook_url=receiver.url).id
            fail(s, job_id, now=t)
        # The task enqueued at the finish makes the first attempt; the retry is left to the row.
        first = deliver(ctx, job_id, now=t)
        assert (first.state, first.attempt) == ("pending", 1)
        assert first.retry_in is not None
        with ctx.sessions() as s:
            row = webhooks.delivery(s, job_id)
            assert row is not None and row.state == "pending"
            retry_at = row.next_attempt_at
        assert t + timedelta(seconds=1) <= retry_at <= t + timedelta(seconds=3)
        # Not before its time; at it, the sweep owes it at once (no grace: the retry is its own).
        assert sweep(ctx, now=retry_at - timedelta(seconds=0.1)) == []
        assert sweep(ctx, now=retry_at) == [job_id]
        # The sweeper's attempts, each at its due time, until webhook_max_attempts (3).
        now, states = retry_at, []
        while owed := sweep(ctx, now=now):
            assert owed == [job_id]
            states.append(deliver(ctx, job_id, now=now).state)
            with ctx.sessions() as s:
                row = webhooks.delivery(s, job_id)
                assert row is not None
                now = row.next_attempt_at
        assert states == ["pending", "failed"]
        assert sweep(ctx, now=now + timedelta(hours=1)) == []
    assert [r.headers["Kiln-Attempt"] for r in receiver.requests] == ["1", "2", "3"]
    with ctx.sessions() as s:
        row = webhooks.delivery(s, job_id)
        assert row is not None and (row.state, row.attempts) == ("failed", 3)


def test_the_sweep_leaves_a_first_attempt_to_its_task_but_not_a_retry(ctx: Context) -> None:
    now = utcnow()
    with ctx.sessions() as s:
        fresh = submit(s, now=now, webhook_url="http://127.0.0.1:9/hook").id
        succeed(ctx, s, fresh, now=now)
        retried = submit(s, now=now, webhook_url="http://127.0.0.1:9/hook").id
        succeed(ctx, s, retried, now=now)
        # retried's first attempt failed a moment ago and is due again now.
        assert webhooks.begin_attempt(s, retried, hold_seconds=60, now=now) is not None
        assert webhooks.record_result(s, retried, 1, delivered=False, error="HTTP 500",
                                      retry_at=now, now=now) == "pending"
    assert sweep(ctx, now=now) == [retried]
    # After the grace, the first attempt's task is taken for lost.
    assert sorted(sweep(ctx, now=now + timedelta(seconds=31))) == sorted([fresh, retried])


def test_the_sweeper_enqueues_a_due_delivery_once_until_its_task_has_ended(
        ctx: Context) -> None:
    # A queue that runs behind: the sweeps after the first enqueue nothing more for "a".
    assert tasks.dispatch(ctx, "job", ["a", "b"]) == ["a", "b"]
    assert tasks.dispatch(ctx, "job", ["a", "c"]) == ["c"]
    assert tasks.dispatch(ctx, "batch", ["a"]) == ["a"]  # another kind, another mark
    tasks.dispatched(ctx, "job", "a")  # its task ended: the next due attempt may go
    assert tasks.dispatch(ctx, "job", ["a", "b"]) == ["a"]
    # Should the task be lost, the mark lapses after an attempt's hold.
    ttl = ctx.redis.ttl(f"{ctx.settings.redis_prefix}webhook-dispatch:job:b")
    assert 0 < ttl <= 3 * ctx.settings.webhook_timeout_seconds + 30


def test_enqueue_job_finished_skips_jobs_without_a_webhook_and_never_raises(
        ctx: Context, redis_prefix: str, tmp_path: object) -> None:
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        plain = submit(s, now=t).id
        succeed(ctx, s, plain, now=t)
        hooked = submit(s, now=t, webhook_url="http://127.0.0.1:9/hook").id
        succeed(ctx, s, hooked, now=t)
        queued = submit(s, now=t, webhook_url="http://127.0.0.1:9/hook").id
        # A broker nobody listens on: the worker group must carry on regardless.
        with tasks.make_celery(make_settings(
                ctx.settings.database_url, redis_prefix, tmp_path,  # type: ignore[arg-type]
                redis_url=f"redis://127.0.0.1:{free_port()}/0")) as app:
            started = time.monotonic()
            assert tasks.enqueue_job_finished(app, s, plain) is False
            assert tasks.enqueue_job_finished(app, s, queued) is False
            assert tasks.enqueue_job_finished(app, s, hooked) is False
            assert time.monotonic() - started < 5


def _guarded(ctx: Context, tmp_path: object, **overrides: Any) -> None:
    ctx.settings = make_settings(ctx.settings.database_url, ctx.settings.redis_prefix, tmp_path,  # type: ignore[arg-type]
                                 **{"webhook_allow_private": False, **overrides})


def test_a_name_resolving_to_loopback_is_given_up_without_a_post(
        ctx: Context, receiver: Receiver, tmp_path: object) -> None:
    _guarded(ctx, tmp_path)
    receiver.fail_first = 0
    url = receiver.url.replace("127.0.0.1", "localhost")
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=url).id
        succeed(ctx, s, job_id, now=t)
    out = deliver(ctx, job_id, now=t)
    assert (out.state, out.attempt, out.status, out.retry_in) == ("failed", 1, None, None)
    assert deliver(ctx, job_id, now=t + timedelta(hours=1)).state == "skipped"
    assert sweep(ctx, now=utcnow()) == []
    time.sleep(0.2)  # a POST, had one been sent, would have arrived by now
    assert receiver.requests == []
    with ctx.sessions() as s:
        row = webhooks.delivery(s, job_id)
        assert row is not None
        assert (row.state, row.attempts, row.last_status) == ("failed", 1, None)
        assert row.last_error is not None
        assert row.last_error.startswith(
            "not sent: localhost resolves to a refused address: 127.0.0.1 is a loopback address")


def test_a_stored_internal_literal_is_given_up_in_production(
        ctx: Context, tmp_path: object) -> None:
    # A job submitted while private destinations were allowed, delivered after they no longer
    # are: the delivery check alone stops it.
    _guarded(ctx, tmp_path, environment="production", webhook_allow_private=None)
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url="http://169.254.169.254/latest/meta-data").id
        fail(s, job_id, now=t)
        out = deliver(ctx, job_id, now=t)
        assert (out.state, out.attempt) == ("failed", 1)
        row = webhooks.delivery(s, job_id)
        assert row is not None
        assert row.last_error == "not sent: 169.254.169.254 is the cloud metadata address"


def test_a_host_that_does_not_resolve_is_retried(
        ctx: Context, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    _guarded(ctx, tmp_path)

    def no_dns(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(netguard.socket, "getaddrinfo", no_dns)
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url="https://hooks.example.com/kiln").id
        succeed(ctx, s, job_id, now=t)
        out = deliver(ctx, job_id, now=t)
        assert (out.state, out.status) == ("pending", None)
        assert out.retry_in is not None and 1.0 <= out.retry_in <= 2.0
        row = webhooks.delivery(s, job_id)
        assert row is not None and row.last_error == (
            "could not resolve the webhook host: [Errno -2] Name or service not known")


def test_a_name_resolving_to_loopback_is_delivered_when_allowed(
        ctx: Context, receiver: Receiver, tmp_path: object) -> None:
    _guarded(ctx, tmp_path, webhook_allow_private=True, environment="production")
    receiver.fail_first = 0
    t = utcnow() - timedelta(minutes=1)
    with ctx.sessions() as s:
        job_id = submit(s, now=t, webhook_url=receiver.url.replace("127.0.0.1", "localhost")).id
        succeed(ctx, s, job_id, now=t)
    assert deliver(ctx, job_id, now=t).state == "delivered"
    assert len(receiver.requests) == 1
