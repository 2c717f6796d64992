"""Webhook signatures by the Standard Webhooks convention (https://www.standardwebhooks.com),
made with the ``standardwebhooks`` library.

Every delivery carries ``webhook-id`` (the event's id, the same on every retry),
``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``: one
``v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` per signing secret, space-separated. The
secrets are the owner's (`storage.webhook_secrets`: the current one, and during a rotation the one
it replaced) and, when the deployment sets ``webhook_secret``, that one last. A receiver verifies
with ``standardwebhooks.Webhook(secret).verify(body, headers)``, which accepts the request when
any one signature matches.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from pydantic import SecretStr
from standardwebhooks import Webhook

WHSEC_PREFIX = "whsec_"


def standard_secret(secret: str) -> str:
    """The ``whsec_<base64>`` form of a secret: a value already in that form is used as it is
    (its base64 part is the key); any other string (a deployment's ``webhook_secret``) is the
    key itself, as UTF-8 bytes."""
    if secret.startswith(WHSEC_PREFIX):
        return secret
    return WHSEC_PREFIX + base64.b64encode(secret.encode()).decode()


def _plain(secret: str | SecretStr) -> str:
    # The settings hold the deployment's secret as a SecretStr (kept out of reprs and logs).
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def standard_headers(secrets: Sequence[str | SecretStr], msg_id: str, body: bytes,
                     timestamp: int | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for ``body``, the event ``msg_id``, sent at ``timestamp``
    (now by default), with one signature per secret in ``secrets``, in that order."""
    if not secrets:
        raise ValueError("a webhook is signed with at least one secret")
    timestamp = int(time.time()) if timestamp is None else timestamp
    at = datetime.fromtimestamp(timestamp, UTC)
    signatures = [Webhook(standard_secret(_plain(s))).sign(msg_id, at, body.decode())
                  for s in secrets]
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signatures)}
