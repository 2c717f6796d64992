"""The settings' secrets: each is a `SecretStr` that no repr or dump of the settings shows, and
each refuses a placeholder value outside the ``local`` environment."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from common.settings import Settings

SECRETS = {"s3_secret_access_key": "s3-secret-for-tests-0123456789",
           "webhook_secret": "webhook-secret-for-tests-0123456789",
           "metrics_token": "metrics-token-for-tests-0123456789"}


def test_secret_settings_are_hidden_in_reprs_and_placeholders_refused() -> None:
    settings = Settings(_env_file=None, **SECRETS)  # type: ignore[arg-type]
    shown = repr(settings) + str(settings) + str(settings.model_dump())
    for name, value in SECRETS.items():
        held = getattr(settings, name)
        assert isinstance(held, SecretStr) and held.get_secret_value() == value
        assert value not in shown, name
    for name in SECRETS:
        with pytest.raises(ValueError, match=f"{name} is the placeholder"):
            Settings(_env_file=None, **{name: "changethis"})  # type: ignore[arg-type]
