"""Webhook signatures: ``Kiln-Signature: t=<unix seconds>,v1=<hex>``.

``v1`` is HMAC-SHA256 under the deployment's ``webhook_secret`` of ``"<t>."`` followed by the exact
request body. Signing the timestamp with the body lets a receiver refuse replays of an old
delivery. Standard library only, so a receiver can import (or copy) `verify`.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "Kiln-Signature"
DEFAULT_TOLERANCE_SECONDS = 300


def digest(secret: str, body: bytes, timestamp: int) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header value for ``body`` sent at ``timestamp`` (now by default)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return f"t={timestamp},v1={digest(secret, body, timestamp)}"


def verify(secret: str, body: bytes, header: str, *,
           tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS, now: float | None = None) -> bool:
    """True when ``header`` signs ``body`` under ``secret`` and its time is within the tolerance.

    Several ``v1=`` entries are accepted (one matching is enough), so a sender can sign with an
    old and a new secret while they are rotated.
    """
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t" and value.isdigit():
            timestamp = int(value)
        elif name == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        return False
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_seconds:
        return False
    expected = digest(secret, body, timestamp)
    return any(hmac.compare_digest(expected, c) for c in candidates)
