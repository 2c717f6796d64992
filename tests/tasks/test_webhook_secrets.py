"""Per-user webhook secrets, checked with the ``standardwebhooks`` library against a real
receiver: a user's deliveries verify with their own secret and not with another user's; during a
rotation they verify with either the old or the new secret, after the overlap only with the new
one; an event whose job is gone is not sent unsigned."""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

from servers import Receiver
from sqlalchemy.orm import Session
from standardwebhooks import Webhook, WebhookVerificationError
from task_helpers import secret_of, submit, succeed, user

from kiln.tasks import Context, deliver, deliver_live, progress_event
from storage import webhook_secrets
from storage.tables import utcnow


def _verifies(secret: str, received: Any) -> bool:
    try:
        Webhook(secret).verify(received.body, received.headers)
    except WebhookVerificationError:
        return False
    return True


def test_a_users_deliveries_verify_with_their_own_secret_and_fail_with_another_users(
        ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    with Receiver() as receiver:
        with ctx.sessions() as s:
            alices = submit(s, now=t, owner="alice", webhook_url=receiver.url).id
            bobs = submit(s, now=t, owner="bob", webhook_url=receiver.url).id
            succeed(ctx, s, alices, now=t)
            succeed(ctx, s, bobs, now=t)
        assert deliver(ctx, alices).state == "delivered"
        assert deliver(ctx, bobs).state == "delivered"
        msg_id, body = progress_event(bobs, 1, 1, 4)
        assert deliver_live(ctx, receiver.url, msg_id, "job.progress", body).state == "delivered"
        got = receiver.wait_for(3)
    a, b = secret_of(ctx, "alice"), secret_of(ctx, "bob")
    assert a != b and a.startswith("whsec_") and len(base64.b64decode(a[6:])) == 32
    assert [(_verifies(a, r), _verifies(b, r)) for r in got] == [
        (True, False), (False, True), (False, True)]
    assert Webhook(a).verify(got[0].body, got[0].headers)["data"]["id"] == alices
    assert Webhook(b).verify(got[2].body, got[2].headers)["type"] == "job.progress"


def test_during_a_rotation_either_secret_verifies_and_after_the_overlap_only_the_new_one(
        ctx: Context) -> None:
    t = utcnow() - timedelta(minutes=1)
    overlap = timedelta(hours=ctx.settings.webhook_secret_overlap_hours)
    assert overlap == timedelta(hours=24)  # the default
    with Receiver() as receiver:
        with ctx.sessions() as s:
            during, after = (submit(s, now=t, webhook_url=receiver.url, seed=i).id
                             for i in (1, 2))
            old = webhook_secrets.ensure(s, user(s).id, now=t).secret
            rotated = webhook_secrets.rotate(s, user(s).id, overlap=overlap, now=t)
            succeed(ctx, s, during, now=t)
            succeed(ctx, s, after, now=t)
        assert (rotated.previous, rotated.previous_until) == (old, t + overlap)
        new = rotated.secret
        assert deliver(ctx, during).state == "delivered"
        assert deliver(ctx, after, now=t + overlap + timedelta(seconds=1)).state == "delivered"
        got = receiver.wait_for(2)
    assert len(got[0].headers["webhook-signature"].split(" ")) == 2
    assert (_verifies(old, got[0]), _verifies(new, got[0])) == (True, True)
    assert len(got[1].headers["webhook-signature"].split(" ")) == 1
    assert (_verifies(old, got[1]), _verifies(new, got[1])) == (False, True)
    assert secret_of(ctx) == new


def test_rotating_again_within_the_overlap_leaves_the_last_two_secrets(session: Session) -> None:
    t = utcnow()
    alice = user(session)
    first = webhook_secrets.ensure(session, alice.id, now=t)
    assert webhook_secrets.ensure(session, alice.id, now=t) == first  # made once
    assert first.signing == [first.secret]
    second = webhook_secrets.rotate(session, alice.id, overlap=timedelta(hours=1), now=t)
    third = webhook_secrets.rotate(session, alice.id, overlap=timedelta(hours=1),
                                   now=t + timedelta(minutes=1))
    assert len({first.secret, second.secret, third.secret}) == 3
    assert third.signing == [third.secret, second.secret]
    later = webhook_secrets.ensure(session, alice.id, now=t + timedelta(hours=2))
    assert later.signing == [third.secret] and later.previous_until is None


def test_a_live_event_whose_job_is_gone_is_not_sent(ctx: Context) -> None:
    with Receiver() as receiver:
        msg_id, body = progress_event("nosuchjob0000000000", 1, 1, 4)
        outcome = deliver_live(ctx, receiver.url, msg_id, "job.progress", body)
        assert (outcome.state, outcome.error) == ("failed", "the job is gone")
    assert receiver.requests == []


def test_a_rotation_without_overlap_stops_the_old_secret_at_once(session: Session) -> None:
    alice = user(session)
    old = webhook_secrets.ensure(session, alice.id).secret
    new = webhook_secrets.rotate(session, alice.id, overlap=timedelta(0))
    assert new.signing == [new.secret] and new.secret != old
