"""``GET /v1/webhook-secret`` and ``POST /v1/webhook-secret/rotate``: the caller's own webhook
signing secret (`storage.webhook_secrets`), made on first need.

Only its owner sees a secret: there is no route to another user's, for admins either. The answers
carry ``Cache-Control: no-store``, so no cache between the client and the API keeps the secret.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from api.deps import CurrentUser, SessionDep, SettingsDep
from storage import webhook_secrets

router = APIRouter(tags=["webhooks"])


class WebhookSecretPublic(BaseModel):
    object: Literal["webhook_secret"] = "webhook_secret"
    secret: str = Field(description="whsec_<base64>: verify your deliveries with it, e.g. "
                                    "standardwebhooks.Webhook(secret).verify(body, headers)")
    created_at: datetime = Field(description="when this secret was made")
    previous_expires_at: datetime | None = Field(
        description="until when the secret this one replaced still signs beside it; "
                    "null: no other secret signs your deliveries")


def _public(found: webhook_secrets.Secrets, response: Response) -> WebhookSecretPublic:
    response.headers["Cache-Control"] = "no-store"
    return WebhookSecretPublic(secret=found.secret, created_at=found.created_at,
                               previous_expires_at=found.previous_until)


@router.get("/v1/webhook-secret", response_model=WebhookSecretPublic)
def get_webhook_secret(user: CurrentUser, session: SessionDep,
                       response: Response) -> WebhookSecretPublic:
    """Your webhook signing secret: every delivery of your jobs and batches is signed with it."""
    return _public(webhook_secrets.ensure(session, user.id), response)


@router.post("/v1/webhook-secret/rotate", response_model=WebhookSecretPublic)
def rotate_webhook_secret(user: CurrentUser, session: SessionDep, settings: SettingsDep,
                          response: Response) -> WebhookSecretPublic:
    """A new webhook signing secret. The one it replaces keeps signing beside it (both
    signatures in ``webhook-signature``) until ``previous_expires_at``
    (``webhook_secret_overlap_hours`` from now), so your receiver can switch meanwhile."""
    overlap = timedelta(hours=settings.webhook_secret_overlap_hours)
    return _public(webhook_secrets.rotate(session, user.id, overlap=overlap), response)
