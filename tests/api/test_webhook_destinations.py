"""Webhook destinations at submit time: outside the local environment (or with
webhook_allow_private off) a webhook_url whose host is an internal IP literal or ``localhost`` is
refused with a 422 naming the field, for single jobs and for batches; names are not resolved. A
URL with credentials in it is refused everywhere."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

import pytest

from common import netguard
from common.settings import Settings

if TYPE_CHECKING:
    from conftest import Api

JOB = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4}
REFUSED = [
    "http://127.0.0.1:9/x",
    "http://[::1]/",
    "http://169.254.169.254/latest/meta-data",
    "http://10.0.0.1/",
    "http://192.168.1.20:8080/hook",
    "http://[fd00::1]/hook",
    "http://[fec0::1]/",  # site-local, which Python's is_global counts as global
    "http://[::ffff:127.0.0.1]/hook",
    "http://0.0.0.0/",
    "http://localhost:8000/hook",
    "http://2130706433/",  # 127.0.0.1 as one number
]
# Accepted: public literals, and names (resolved and checked only when the webhook is sent).
ACCEPTED = ["https://hooks.example.com/kiln", "http://93.184.216.34/hook",
            "https://[2606:4700::1]/hook"]


def _configure(api: Api, **changes: object) -> Api:
    """The app of ``api`` from now on runs with these settings changed."""
    api.settings = api.settings.model_copy(update={"max_queued_jobs_per_user": 50, **changes})
    api.app.state.settings = api.settings
    return api


@pytest.fixture(params=[{"environment": "production"}, {"webhook_allow_private": False}],
                ids=["production", "flag-off"])
def guarded(request: pytest.FixtureRequest, api: Api) -> Api:
    return _configure(api, **request.param)


def _submit(api: Api, url: str):  # noqa: ANN202
    return api.client.post("/v1/jobs", json={**JOB, "webhook_url": url},
                           headers=api.auth("alice"))


def test_internal_destinations_are_refused_naming_the_field(guarded: Api) -> None:
    before = guarded.snapshot()
    for url in REFUSED:
        r = _submit(guarded, url)
        assert r.status_code == 422, (url, r.text)
        problems = r.json()["errors"]
        assert [p["field"] for p in problems] == ["webhook_url"], url
        assert "address" in problems[0]["message"] or "loopback" in problems[0]["message"], url
    assert guarded.snapshot() == before
    r = _submit(guarded, "http://169.254.169.254/latest/meta-data")
    assert r.json()["detail"] == ("webhook_url: 169.254.169.254 is the cloud metadata address; "
                                  "webhooks go to public addresses only")


def test_public_destinations_and_names_are_accepted(guarded: Api) -> None:
    for url in ACCEPTED:
        r = _submit(guarded, url)
        assert r.status_code == 201, (url, r.text)
        assert r.json()["webhook_url"] == url


@pytest.mark.parametrize("changes", [{"environment": "local"},
                                     {"environment": "production", "webhook_allow_private": True}],
                         ids=["local", "production-flag-on"])
def test_internal_destinations_are_accepted_when_allowed(api: Api, changes: dict) -> None:
    _configure(api, **changes)
    for url in REFUSED[:4]:
        r = _submit(api, url)
        assert r.status_code == 201, (url, r.text)


@pytest.mark.parametrize("changes", [{"environment": "production"}, {"environment": "local"}],
                         ids=["production", "local"])
@pytest.mark.parametrize("url", ["http://a@127.0.0.1/", "https://user:pw@hooks.example.com/k"])
def test_credentials_in_the_url_are_refused_in_every_environment(
        api: Api, changes: dict, url: str) -> None:
    _configure(api, **changes)
    before = api.snapshot()
    r = _submit(api, url)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == ("webhook_url: must not carry a user name or password "
                                  "(user@host): they would be sent and stored")
    r = api.client.post("/v1/batches", json={"jobs": [JOB], "webhook_url": url},
                        headers=api.auth("alice"))
    assert r.status_code == 422, r.text
    assert [p["field"] for p in r.json()["errors"]] == ["webhook_url"]
    assert api.snapshot() == before


def test_a_batch_names_the_refused_default_or_line(guarded: Api) -> None:
    def post(body: dict) -> list[dict]:
        r = guarded.client.post("/v1/batches", json=body, headers=guarded.auth("alice"))
        assert r.status_code == 422, r.text
        return r.json()["errors"]

    defaults = {k: v for k, v in JOB.items() if k != "prompt"}
    bad_default = post({"defaults": {**defaults, "webhook_url": "http://10.0.0.1/"},
                        "jobs": [{"prompt": "a"}, {"prompt": "b"}]})
    assert [p["field"] for p in bad_default] == ["defaults.webhook_url"]
    bad_line = post({"defaults": {**defaults, "webhook_url": "https://hooks.example.com/k"},
                     "jobs": [{"prompt": "a"}, {"prompt": "b", "webhook_url": "http://[::1]/"}]})
    assert [(p["line"], p["field"]) for p in bad_line] == [(2, "line 2: webhook_url")]


@pytest.mark.parametrize(("address", "refused"), [
    ("127.0.0.1", True), ("::1", True), ("10.1.2.3", True), ("172.16.0.1", True),
    ("192.168.0.1", True), ("169.254.169.254", True), ("fe80::1", True), ("fc00::1", True),
    ("224.0.0.1", True), ("ff02::1", True), ("0.0.0.0", True), ("::", True),
    ("240.0.0.1", True), ("255.255.255.255", True), ("100.64.0.1", True),
    ("::ffff:10.0.0.1", True), ("::ffff:169.254.169.254", True), ("2002:7f00:1::", True),
    ("64:ff9b::a00:1", True), ("::127.0.0.1", True), ("fec0::1", True),
    ("feff:ffff::1", True),
    ("8.8.8.8", False), ("93.184.216.34", False), ("2606:4700::1", False),
    ("::ffff:8.8.8.8", False),
])
def test_address_ranges(address: str, refused: bool) -> None:
    assert (netguard.address_refusal(ipaddress.ip_address(address)) is not None) is refused


def test_literal_checks_need_no_dns_and_only_http_schemes_pass() -> None:
    assert netguard.literal_refusal("ftp://93.184.216.34/x") == "must be an http or https URL"
    assert netguard.literal_refusal("http://LOCALHOST./x") is not None
    assert netguard.literal_refusal("http://app.localhost/x") is not None
    assert netguard.literal_refusal("http://no-such-host.invalid/x") is None


def test_private_allowed_follows_the_flag_then_the_environment() -> None:
    def allowed(**overrides: object) -> bool:
        return netguard.private_allowed(Settings(_env_file=None, **overrides))  # type: ignore[call-arg]

    assert allowed(environment="local") is True
    assert allowed(environment="staging") is False
    assert allowed(environment="production") is False
    assert allowed(webhook_allow_private=False) is False
    assert allowed(environment="production", webhook_allow_private=True) is True


def test_a_deployment_that_names_no_environment_keeps_webhooks_off_internal_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_ENVIRONMENT", raising=False)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.environment == "production"
    assert netguard.private_allowed(settings) is False
    with pytest.raises(ValueError, match="placeholder"):
        Settings(_env_file=None, webhook_secret="changethis")  # type: ignore[call-arg]
