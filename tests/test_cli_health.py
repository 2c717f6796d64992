"""``kiln health worker`` and ``kiln health beat``, the compose healthchecks of the worker group
and Celery beat, against a migrated database and a schedule file."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from common.settings import Settings
from kiln.cli import app
from kiln.tasks import beat_schedule_path
from storage.tables import utcnow
from storage.workers import GroupReport, mark_stopped, report_group
from tests.conftest import Database


def _report(db: Database, group_id: str, *, host: str = "node-a", state: str = "ready",
            reason: str | None = None, seconds_ago: float = 0) -> None:
    report = GroupReport(id=group_id, name=group_id, host=host, model="kiln-tiny",
                         mode="allgather", platform="cpu", dp_size=1, world_size=1, state=state,
                         reason=reason)
    with db.session() as s:
        report_group(s, report, now=utcnow() - timedelta(seconds=seconds_ago))


def _check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["health", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_health_worker_is_healthy_only_while_this_hosts_newest_group_is_ready_and_reporting(
    db: Database, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("KILN_DATABASE_URL", db.url)
    monkeypatch.setenv("KILN_WORKER_STALE_SECONDS", "60")
    monkeypatch.chdir(tmp_path)  # no stray .env file is read

    code, output = _check("worker", "--host", "node-a")
    assert (code, output) == (1, "unhealthy: no worker group has reported from node-a\n")

    _report(db, "other-host", host="node-b")
    _report(db, "g1", state="starting")
    code, output = _check("worker", "--host", "node-a")
    assert (code, output) == (1, "unhealthy: group g1 is starting\n")

    _report(db, "g1")
    code, output = _check("worker", "--host", "node-a")
    assert code == 0 and output.startswith("group g1 ready, reported ")

    _report(db, "g1", state="degraded", reason="Redis unreachable")
    code, output = _check("worker", "--host", "node-a")
    assert (code, output) == (1, "unhealthy: group g1 is degraded: Redis unreachable\n")

    _report(db, "g1", seconds_ago=90)
    code, output = _check("worker", "--host", "node-a")
    assert code == 1 and output.startswith("unhealthy: group g1 last reported 9")
    assert output.endswith("s ago (worker_stale_seconds: 60)\n")

    # The launcher started the group again: the newest group of the host decides.
    with db.session() as s:
        mark_stopped(s, "g1", reason="rank 0 died")
    time.sleep(0.01)  # the new group's started_at sorts after the old one's
    _report(db, "g2")
    code, output = _check("worker", "--host", "node-a")
    assert code == 0 and output.startswith("group g2 ready")


def test_health_worker_says_so_when_the_database_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("KILN_DATABASE_URL", f"sqlite:///{tmp_path / 'absent' / 'kiln.db'}")
    monkeypatch.chdir(tmp_path)
    code, output = _check("worker", "--host", "node-a")
    assert code == 1 and output.startswith("unhealthy: the database cannot be read: "
                                           "OperationalError: ")


def test_health_beat_is_healthy_while_beats_schedule_file_is_fresh(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("KILN_REDIS_PREFIX", "healthtest:")
    monkeypatch.setenv("KILN_REAPER_INTERVAL_SECONDS", "15")
    monkeypatch.setenv("KILN_WEBHOOK_SWEEP_INTERVAL_SECONDS", "15")
    monkeypatch.chdir(tmp_path)
    path = beat_schedule_path(Settings())
    code, output = _check("beat")
    assert (code, output) == (1, f"unhealthy: beat has written no schedule at {path}\n")

    # dbm.dumb's three files, as shelve writes them where no dbm.gnu is installed.
    path.parent.mkdir(parents=True)
    for suffix in (".dat", ".dir", ".bak"):
        Path(f"{path}{suffix}").write_bytes(b"")
    code, output = _check("beat")
    assert code == 0 and re.fullmatch(r"beat wrote its schedule [0-9] s ago\n", output)

    # Beat syncs at most every 180 s, at its next send (every 15 s here); a minute more of slack.
    old = time.time() - 256
    for suffix in (".dat", ".dir", ".bak"):
        os.utime(f"{path}{suffix}", (old, old))
    code, output = _check("beat")
    assert code == 1 and re.fullmatch(
        rf"unhealthy: beat last wrote {re.escape(str(path))} 25[6-9] s ago \(more than 255 s\)\n",
        output)
