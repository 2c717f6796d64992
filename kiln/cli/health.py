"""``kiln health worker`` and ``kiln health beat``: container healthchecks (docker-compose.yml)
for the two processes that answer no request. Each exits 0 and prints one line when the process
is doing its work, and exits 1 with the reason when it is not.
"""

from __future__ import annotations

import socket
import time
from typing import Annotated

import typer

from common.settings import Settings

health_app = typer.Typer(no_args_is_help=True, help="Container healthchecks.")
app = typer.Typer()
app.add_typer(health_app, name="health")

HostOption = Annotated[str | None, typer.Option(
    help="The worker group's host name as it reports it (default: this machine's, which in a "
         "container is the container's).")]


def _unhealthy(reason: str) -> typer.Exit:
    typer.echo(f"unhealthy: {reason}", err=True)
    return typer.Exit(1)


@health_app.command("worker")
def worker(host: HostOption = None) -> None:
    """Healthy when the newest worker group of this host is ready and reported itself within
    worker_stale_seconds (rank 0 reports every few seconds, from the moment its model is
    loaded)."""
    # Here, not at the top: SQLAlchemy loads only for the check that reads the database.
    from sqlalchemy.exc import SQLAlchemyError

    from storage.db import make_engine, make_session_factory
    from storage.tables import utcnow
    from storage.workers import list_groups

    settings = Settings()
    host = host or socket.gethostname()
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            groups = list_groups(session, stale_after_seconds=settings.worker_stale_seconds,
                                 include_stopped=True)
            found = next(((g, stale) for g, stale in groups if g.host == host), None)
    except SQLAlchemyError as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise _unhealthy(f"the database cannot be read: {type(exc).__name__}: {first}") from None
    finally:
        engine.dispose()
    if found is None:
        raise _unhealthy(f"no worker group has reported from {host}")
    group, stale = found
    age_seconds = (utcnow() - group.heartbeat_at).total_seconds()
    if stale:
        raise _unhealthy(f"group {group.id} last reported {age_seconds:.0f} s ago "
                         f"(worker_stale_seconds: {settings.worker_stale_seconds})")
    if group.state != "ready":
        why = f": {group.state_reason}" if group.state_reason else ""
        raise _unhealthy(f"group {group.id} is {group.state}{why}")
    typer.echo(f"group {group.id} ready, reported {age_seconds:.0f} s ago")


@health_app.command("beat")
def beat() -> None:
    """Healthy when Celery beat's schedule file was written lately: beat writes it at start and
    then, while it sends the periodic tasks, at most every sync_every seconds, at the first send
    after that."""
    # Here, not at the top: Celery and the task module load only for this check.
    from celery.beat import PersistentScheduler

    from kiln.tasks import beat_schedule, beat_schedule_path

    settings = Settings()
    path = beat_schedule_path(settings)
    # The dbm module that shelve picks decides the suffix (none, .db, or .dat/.dir/.bak).
    files = [p for p in path.parent.glob(f"{path.name}*") if p.is_file()]
    if not files:
        raise _unhealthy(f"beat has written no schedule at {path}")
    shortest = min(entry["schedule"] for entry in beat_schedule(settings).values())
    # A sync is due sync_every after the last, and happens with the next task sent.
    max_age_seconds = PersistentScheduler.sync_every + shortest + 60
    age_seconds = time.time() - max(p.stat().st_mtime for p in files)
    if age_seconds > max_age_seconds:
        raise _unhealthy(f"beat last wrote {path} {age_seconds:.0f} s ago (more than "
                         f"{max_age_seconds:.0f} s)")
    typer.echo(f"beat wrote its schedule {age_seconds:.0f} s ago")
