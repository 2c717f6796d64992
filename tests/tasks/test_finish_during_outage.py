"""What a worker group does with the database refusing connections at the moment a job ends,
against real PostgreSQL behind a proxy that refuses (found by the soak: a failed group's attempts
were charged by the reaper, and a webhook look-up left rank 0's session unusable):

- the launcher of a failed group waits for the database to end the group's attempts (the
  crashed rank's job charged, the others not), instead of leaving them to lapse and be charged;
- asking for a finished job's webhooks while the database is out returns False and leaves the
  caller's session usable once the database is back."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faults import TcpProxy
from sqlalchemy import make_url, select, text
from task_helpers import make_settings, submit

from kiln import tasks
from kiln.worker import recover_attempts
from runtime.launch import RankFailure
from storage import lifecycle
from storage.db import make_engine, make_session_factory
from storage.tables import Job

OUTAGE = 3.0  # seconds the proxy refuses


def _proxied(db_url: str, proxy: TcpProxy) -> str:
    return make_url(db_url).set(host="127.0.0.1", port=proxy.port) \
        .render_as_string(hide_password=False)


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_failed_group_ends_its_attempts_once_the_database_answers_again(
        db: Any, redis_prefix: str, tmp_path: Path) -> None:
    with db.session() as s:
        jobs = [submit(s).id for _ in range(2)]
        for rank, job_id in enumerate(jobs):
            assert lifecycle.claim_job(s, job_id, worker_group_id="g1", rank=rank,
                                       lease_seconds=60) is not None
    url = make_url(db.url)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        settings = make_settings(_proxied(db.url, proxy), redis_prefix, tmp_path,
                                 lease_seconds=60)
        proxy.refuse()
        out: dict[str, Any] = {}
        failure = RankFailure("rank 1 exited with -9", ranks=(1,), exit_codes={1: -9})
        worker = threading.Thread(target=lambda: out.update(
            charged=recover_attempts(settings, "g1", failure)))
        worker.start()
        time.sleep(OUTAGE)
        with db.session() as s:  # nothing could be written meanwhile
            assert {j.state for j in s.scalars(select(Job).where(Job.id.in_(jobs)))} == \
                {"running"}
        proxy.accept()
        back = time.monotonic()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert time.monotonic() - back < 10, "ended soon after the database answered"
    assert out["charged"] == 1
    with db.session() as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(jobs)))}
    survivor, crashed = rows[jobs[0]], rows[jobs[1]]
    assert (crashed.state, crashed.attempts, crashed.uncharged_attempts) == ("queued", 1, 0)
    assert crashed.error_code == "rank_crashed"
    assert (survivor.state, survivor.attempts, survivor.uncharged_attempts) == ("queued", 1, 1)
    assert survivor.error_code == "group_failed"


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_asking_for_webhooks_during_an_outage_leaves_the_session_usable(
        db: Any, redis_prefix: str, tmp_path: Path) -> None:
    url = make_url(db.url)
    app = tasks.make_celery(make_settings(db.url, redis_prefix, tmp_path))
    with app, TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        engine = make_engine(_proxied(db.url, proxy), pool_size=1, max_overflow=0)
        try:
            with make_session_factory(engine)() as session:
                assert session.execute(text("SELECT 1")).scalar() == 1
                proxy.refuse()
                assert tasks.enqueue_job_finished(app, session, "no-such-job") is False
                proxy.accept()
                assert session.execute(text("SELECT 1")).scalar() == 1
        finally:
            engine.dispose()
