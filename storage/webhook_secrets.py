"""Each user's webhook signing secret, in the Standard Webhooks form ``whsec_<base64>``.

A user's deliveries are signed with their own secret, so a receiver that verifies with it accepts
only events of that user's jobs and batches. A secret is made on first need (the first delivery,
or the first time its owner asks for it). `rotate` replaces it; the replaced secret keeps signing
beside the new one for the overlap given, so a receiver can switch at its own time.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.tables import Job, WebhookSecret, utcnow

PREFIX = "whsec_"
SECRET_BYTES = 32  # the HMAC-SHA256 key: as long as the hash


@dataclass(frozen=True, slots=True)
class Secrets:
    """A user's secrets at one moment."""

    secret: str  # the current one
    created_at: datetime  # when it was made
    previous: str | None  # the one it replaced, while that still signs
    previous_until: datetime | None  # until when it does

    @property
    def signing(self) -> list[str]:
        """The secrets a delivery is signed with now: the current one first."""
        return [self.secret] if self.previous is None else [self.secret, self.previous]


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def _read(session: Session, user_id: int, now: datetime) -> Secrets | None:
    row = session.execute(
        select(WebhookSecret.secret, WebhookSecret.created_at, WebhookSecret.previous_secret,
               WebhookSecret.previous_until).where(WebhookSecret.user_id == user_id)
    ).first()
    if row is None:
        return None
    secret, created_at, previous, until = row
    if previous is None or until is None or until <= now:
        return Secrets(secret=secret, created_at=created_at, previous=None, previous_until=None)
    return Secrets(secret=secret, created_at=created_at, previous=previous, previous_until=until)


def ensure(session: Session, user_id: int, *, now: datetime | None = None) -> Secrets:
    """The user's secrets, the current one made now if they have none; commits."""
    now = now or utcnow()
    found = _read(session, user_id, now)
    if found is None:
        try:
            session.execute(insert(WebhookSecret).values(user_id=user_id, secret=new_secret(),
                                                         created_at=now))
            session.commit()
        except IntegrityError:
            session.rollback()  # a concurrent delivery made it first: that one is the secret
        found = _read(session, user_id, now)
        assert found is not None  # just made, here or concurrently
    session.commit()  # end the read transaction
    return found


def rotate(session: Session, user_id: int, *, overlap: timedelta,
           now: datetime | None = None) -> Secrets:
    """A new current secret for the user; the replaced one keeps signing for ``overlap``.
    Rotating again within an overlap ends the older secret's: only the last two sign."""
    now = now or utcnow()
    ensure(session, user_id, now=now)
    # One UPDATE: its right-hand sides read the row as it was, so two rotations at once each
    # move a real secret to previous_secret.
    session.execute(
        update(WebhookSecret).where(WebhookSecret.user_id == user_id)
        .values(previous_secret=WebhookSecret.secret, previous_until=now + overlap,
                secret=new_secret(), created_at=now))
    session.commit()
    found = _read(session, user_id, now)
    assert found is not None
    session.commit()
    return found


def ensure_for_job(session: Session, job_id: str, *, now: datetime | None = None) -> Secrets | None:
    """The secrets of the owner of job ``job_id`` (`ensure`); None when there is no such job."""
    owner_id = session.scalar(select(Job.owner_id).where(Job.id == job_id))
    if owner_id is None:
        session.rollback()
        return None
    return ensure(session, owner_id, now=now)
