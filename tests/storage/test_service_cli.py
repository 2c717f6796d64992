"""`kiln db upgrade` and `kiln keys ...` (API keys and webhook secrets) against a fresh SQLite
file."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect
from typer.testing import CliRunner

from kiln.cli import admin_key, app
from storage import webhook_secrets
from storage.db import make_engine, make_session_factory
from storage.users import authenticate, user_named


def test_db_upgrade_then_keys_create_prints_a_working_key_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'var' / 'kiln.db'}"
    monkeypatch.setenv("KILN_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)  # no stray .env file is read
    runner = CliRunner()
    result = runner.invoke(app, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    engine = make_engine(url)
    assert "jobs" in inspect(engine).get_table_names()

    created = runner.invoke(app, ["keys", "create", "--user", "ops", "--admin"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[0]
    with make_session_factory(engine)() as session:
        user = authenticate(session, key)
        assert user is not None and user.name == "ops" and user.is_admin
    listed = runner.invoke(app, ["keys", "list"])
    assert key[5:17] in listed.stdout and key not in listed.stdout  # prefix only, never the key
    revoked = runner.invoke(app, ["keys", "revoke", key[5:17]])
    assert revoked.exit_code == 0
    with make_session_factory(engine)() as session:
        assert authenticate(session, key) is None
    engine.dispose()


def test_keys_rotate_replaces_a_key_and_kiln_ups_admin_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'var' / 'kiln.db'}"
    monkeypatch.setenv("KILN_DATABASE_URL", url)
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["db", "upgrade"]).exit_code == 0
    old = runner.invoke(app, ["keys", "create", "--user", "ops"]).stdout.strip()

    rotated = runner.invoke(app, ["keys", "rotate", old[5:17]])
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip().splitlines()[0]
    engine = make_engine(url)
    with make_session_factory(engine)() as session:
        assert authenticate(session, old) is None
        user = authenticate(session, new)
        assert user is not None and user.name == "ops"
    again = runner.invoke(app, ["keys", "rotate", old[5:17]])
    assert again.exit_code != 0 and "no active key" in again.output

    # kiln up's admin key: the new key goes to its file (mode 0600), not to the terminal.
    with make_session_factory(engine)() as session:
        first = admin_key.ensure(session, tmp_path / "var")
    key_file = tmp_path / "var" / "admin.key"
    rotated = runner.invoke(app, ["keys", "rotate", first.prefix])
    assert rotated.exit_code == 0, rotated.output
    replaced = key_file.read_text().strip()
    assert replaced != first.key and replaced not in rotated.output
    assert key_file.stat().st_mode & 0o777 == 0o600
    with make_session_factory(engine)() as session:
        assert authenticate(session, first.key) is None
        assert admin_key.ensure(session, tmp_path / "var").how == "kept"
    listed = runner.invoke(app, ["keys", "list"]).stdout.splitlines()
    assert [line.split()[1:4] for line in listed] == [
        ["ops", "user", "revoked"], ["ops", "user", "active"],
        ["admin", "admin", "revoked"], ["admin", "admin", "active"]]
    engine.dispose()


def test_keys_webhook_secret_prints_a_users_secret_and_rotates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'var' / 'kiln.db'}"
    monkeypatch.setenv("KILN_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["db", "upgrade"]).exit_code == 0
    assert runner.invoke(app, ["keys", "create", "--user", "ops"]).exit_code == 0

    shown = runner.invoke(app, ["keys", "webhook-secret", "--user", "ops"])
    assert shown.exit_code == 0, shown.output
    secret = shown.stdout.strip()
    assert secret.startswith("whsec_")
    assert runner.invoke(app, ["keys", "webhook-secret", "--user", "ops"]).stdout.strip() == secret
    rotated = runner.invoke(app, ["keys", "webhook-secret", "--user", "ops", "--rotate"])
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip()
    assert new.startswith("whsec_") and new != secret
    assert "still signs until" in rotated.stderr
    engine = make_engine(url)
    with make_session_factory(engine)() as session:
        ops = user_named(session, "ops")
        assert ops is not None
        assert webhook_secrets.ensure(session, ops.id).signing == [new, secret]
    engine.dispose()
    unknown = runner.invoke(app, ["keys", "webhook-secret", "--user", "nobody"])
    assert unknown.exit_code != 0 and "no such user" in unknown.output
