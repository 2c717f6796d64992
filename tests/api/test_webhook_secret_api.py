"""``GET /v1/webhook-secret`` and ``POST /v1/webhook-secret/rotate``: each user reads and rotates
their own secret only (an admin included), answers are not cached, and a rotation keeps the old
secret signing for ``webhook_secret_overlap_hours``."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pytest

from storage import webhook_secrets
from storage.tables import utcnow
from storage.users import revoke_api_key, user_named

if TYPE_CHECKING:
    from conftest import Api


def _signing(api: Api, name: str) -> list[str]:
    with api.session() as s:
        found = user_named(s, name)
        assert found is not None
        return webhook_secrets.ensure(s, found.id).signing


def test_each_user_reads_their_own_secret_and_no_one_elses(api: Api) -> None:
    assert api.client.get("/v1/webhook-secret").status_code == 401
    got = {}
    for who in ("alice", "bob", "root"):
        r = api.client.get("/v1/webhook-secret", headers=api.auth(who))
        assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
        body = r.json()
        assert body["object"] == "webhook_secret" and body["previous_expires_at"] is None
        assert body["secret"].startswith("whsec_")
        got[who] = body["secret"]
        assert _signing(api, who) == [body["secret"]]  # the one deliveries are signed with
    assert len(set(got.values())) == 3  # the admin's answer is the admin's own secret
    again = api.client.get("/v1/webhook-secret", headers=api.auth("alice")).json()
    assert again["secret"] == got["alice"]
    paths = [p for p in api.client.get("/openapi.json").json()["paths"] if "webhook" in p]
    assert sorted(paths) == ["/v1/webhook-secret", "/v1/webhook-secret/rotate"]


def test_a_rotation_answers_the_new_secret_and_keeps_the_old_one_signing_for_the_overlap(
        api: Api) -> None:
    old = api.client.get("/v1/webhook-secret", headers=api.auth("alice")).json()["secret"]
    bobs = api.client.get("/v1/webhook-secret", headers=api.auth("bob")).json()["secret"]
    before = utcnow()
    r = api.client.post("/v1/webhook-secret/rotate", headers=api.auth("alice"))
    assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
    rotated = r.json()
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != old
    until = datetime.fromisoformat(rotated["previous_expires_at"])
    overlap = timedelta(hours=api.settings.webhook_secret_overlap_hours)
    assert before + overlap <= until <= utcnow() + overlap
    assert api.client.get("/v1/webhook-secret", headers=api.auth("alice")).json() == rotated
    assert _signing(api, "alice") == [rotated["secret"], old]
    # Bob's secret is his own business.
    assert _signing(api, "bob") == [bobs]
    assert api.client.post("/v1/webhook-secret/rotate").status_code == 401


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_revoked_key_reads_no_secret(api: Api, method: str) -> None:
    with api.session() as s:
        assert revoke_api_key(s, api.keys["bob"][5:17])  # before its first use: not cached
    path = "/v1/webhook-secret" + ("/rotate" if method == "POST" else "")
    assert api.client.request(method, path, headers=api.auth("bob")).status_code == 401
