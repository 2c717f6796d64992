"""Keyset cursors on (created_at, id) for the pages of job and batch lists."""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime

from storage.submission import is_job_id
from storage.tables import Batch, Job


def encode_cursor(row: Job | Batch) -> str:
    """A keyset cursor after ``row`` (a job or a batch: both ids look alike)."""
    raw = f"{row.created_at.isoformat()}|{row.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at in UTC, id) after which the next page starts. Raises ValueError for
    anything that `encode_cursor` did not make, among them times that have no UTC equivalent
    (year 1 east of UTC, year 9999 west of it)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, job_id = raw.split("|", 1)
        created = datetime.fromisoformat(stamp)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError("cursor is not one this API returned") from exc
    if created.tzinfo is None or not is_job_id(job_id):
        raise ValueError("cursor is not one this API returned")
    try:
        return created.astimezone(UTC), job_id
    except OverflowError as exc:
        raise ValueError("cursor is not one this API returned") from exc
