"""Webhook signatures, two of them on every signed delivery.

The Standard Webhooks ones (https://www.standardwebhooks.com), made by the ``standardwebhooks``
library: ``webhook-id`` (the event's id, the same on every retry), ``webhook-timestamp`` (unix
seconds of this attempt) and ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``
under the secret in its ``whsec_<base64>`` form (`standard_secret`). A receiver verifies them with
``standardwebhooks.Webhook(secret).verify(body, headers)``.

And kiln's own, kept for the receivers written against it:
``Kiln-Signature: t=<unix seconds>,v1=<hex>``.

``v1`` is HMAC-SHA256 under the deployment's ``webhook_secret`` of ``"<t>."`` followed by the exact
request body. Signing the timestamp with the body lets a receiver refuse replays of an old
delivery. Standard library only, so a receiver can import (or copy) `verify`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from datetime import UTC, datetime

from pydantic import SecretStr
from standardwebhooks import Webhook

HEADER = "Kiln-Signature"
DEFAULT_TOLERANCE_SECONDS = 300
WHSEC_PREFIX = "whsec_"


def standard_secret(secret: str) -> str:
    """The ``whsec_<base64>`` form of the deployment's ``webhook_secret``: a value already in that
    form is used as it is (its base64 part is the key); any other string is the key itself, as
    UTF-8 bytes, so ``Kiln-Signature`` and ``webhook-signature`` are made with the same key."""
    if secret.startswith(WHSEC_PREFIX):
        return secret
    return WHSEC_PREFIX + base64.b64encode(secret.encode()).decode()


def _plain(secret: str | SecretStr) -> str:
    # The settings hold the secret as a SecretStr (kept out of reprs and logs).
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def standard_headers(secret: str | SecretStr, msg_id: str, body: bytes,
                     timestamp: int | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for ``body``, the event ``msg_id``, sent at ``timestamp``
    (now by default)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    at = datetime.fromtimestamp(timestamp, UTC)
    signature = Webhook(standard_secret(_plain(secret))).sign(msg_id, at, body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature}


def digest(secret: str, body: bytes, timestamp: int) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str | SecretStr, body: bytes, timestamp: int | None = None) -> str:
    """The header value for ``body`` sent at ``timestamp`` (now by default)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return f"t={timestamp},v1={digest(_plain(secret), body, timestamp)}"


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
