"""`kiln db upgrade` and `kiln keys ...` against a fresh SQLite file."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect
from typer.testing import CliRunner

from kiln.cli import app
from storage.db import make_engine, make_session_factory
from storage.users import authenticate


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
