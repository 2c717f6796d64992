"""Keyset cursors on (created_at, id) for the pages of job and batch lists."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

from storage.submission import is_job_id
from storage.tables import Batch, Job


def encode_cursor(row: Job | Batch) -> str:
    """A keyset cursor after ``row`` (a job or a batch: both ids look alike)."""
    raw = f"{row.created_at.isoformat()}|{row.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError for anything that `encode_cursor` did not make."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, job_id = raw.split("|", 1)
        created = datetime.fromisoformat(stamp)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError("cursor is not one this API returned") from exc
    if created.tzinfo is None or not is_job_id(job_id):
        raise ValueError("cursor is not one this API returned")
    return created, job_id
