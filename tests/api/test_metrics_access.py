"""``GET /metrics`` is open by default (a laptop's Prometheus needs nothing) and, with
``metrics_token`` set, answers only ``Authorization: Bearer <token>``, as Prometheus' scrape
``authorization`` setting sends it. A placeholder token (``changethis``) is refused at startup
like every other secret's, outside ``local``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from pydantic import SecretStr

from common.settings import Settings

if TYPE_CHECKING:
    from conftest import Api

TOKEN = "metrics-token-for-tests-0123456789"


def test_metrics_are_open_without_a_token(api: Api) -> None:
    assert api.settings.metrics_token is None
    r = api.client.get("/metrics")
    assert r.status_code == 200 and "kiln_host_memory_total_bytes" in r.text


def test_metrics_answer_only_the_bearer_token_when_one_is_set(api: Api) -> None:
    api.app.state.settings = api.settings.model_copy(update={"metrics_token": SecretStr(TOKEN)})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN},
                    api.auth("root")):  # an API key, even an admin's, is not the token
        r = api.client.get("/metrics", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="kiln metrics"'
        assert "kiln_" not in r.text and TOKEN not in r.text
    for scheme in ("Bearer", "bearer"):
        r = api.client.get("/metrics", headers={"Authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200 and "kiln_host_memory_total_bytes" in r.text
    # The other unauthenticated routes stay open.
    assert api.client.get("/healthz").status_code == 200


def test_the_token_is_read_from_the_environment_and_never_shown(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("KILN_METRICS_TOKEN", TOKEN)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.metrics_token is not None
    assert settings.metrics_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in str(settings.model_dump())


@pytest.mark.parametrize("placeholder", ["changethis", "CHANGEME", "secret"])
def test_a_placeholder_token_is_refused_outside_local_and_warned_about_in_local(
        placeholder: str) -> None:
    with pytest.raises(ValueError, match="metrics_token is the placeholder"):
        Settings(_env_file=None, metrics_token=placeholder)  # type: ignore[call-arg]
    with pytest.warns(UserWarning, match="metrics_token is the placeholder"):
        local = Settings(_env_file=None, environment="local",  # type: ignore[call-arg]
                         metrics_token=placeholder)
    assert local.metrics_token is not None
    assert Settings(_env_file=None, metrics_token=TOKEN).metrics_token is not None  # type: ignore[call-arg]
