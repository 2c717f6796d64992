"""Shared database and Redis fixtures.

`db` is parametrized over SQLite (a temporary file) and the real PostgreSQL server; each backend
gets a fresh database created ONLY through the Alembic migrations, once per test run, and every
test leaves it empty. PostgreSQL uses a uniquely named database, dropped at the end, so concurrent
runs do not collide. `redis_prefix` gives each test its own Redis key prefix and deletes those
keys afterwards.

The worker group's fault scenarios (marked ``fault``: a rank, the launcher or the group killed or
stopped, Redis, the database or the output store gone) and the other tests that start a whole
worker group or service (marked ``group``) run on PostgreSQL only in ``make test``, which keeps
the suite's wall time in bounds on two cores: on SQLite the same processes would run the same
code a second time, and ``kiln up``'s tests (tests/test_cli_up.py) keep a whole service on
SQLite in the suite. ``KILN_FAULTS_ON_EVERY_BACKEND=1`` (set by ``make chaos``) runs them on
SQLite too. Everything else runs on both. The slowest scenarios
(marked ``chaos``: each a minute or more of outages, long renders or a benchmark run) run only
with ``KILN_CHAOS=1``, set by ``make chaos``.

Tests that reach no server and start no process are marked ``unit`` here, at collection:
``make check`` runs those alone, in a few minutes; ``make test`` runs everything. A test is not a
unit test when it is marked ``slow``, when it uses a database or Redis fixture (directly or
through another fixture), or when its module imports what starts a server or a process
(`_STARTERS`, `_STARTER_CALLS`).

Servers: ``KILN_TEST_POSTGRES_URL`` (default postgresql+psycopg://postgres@127.0.0.1:5432/test)
and ``KILN_TEST_REDIS_URL`` (default redis://127.0.0.1:6379/0). When one is unreachable its tests
are skipped, except under CI (``CI`` set), where that is an error.
"""

from __future__ import annotations

import multiprocessing.process
import os
import secrets
import subprocess
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import redis
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

import migrations
from storage.db import make_engine, make_session_factory
from storage.tables import Base

POSTGRES_URL = os.environ.get(
    "KILN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _unavailable(what: str, exc: Exception) -> None:
    message = f"{what} is not reachable: {exc}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass(frozen=True, slots=True)
class Database:
    backend: str  # "sqlite" | "postgresql"
    url: str
    engine: Engine

    def session(self) -> Session:
        return make_session_factory(self.engine)()


def _chaos_only(item: pytest.Item) -> bool:
    return item.get_closest_marker("chaos") is not None and not os.environ.get("KILN_CHAOS")


def _postgres_only(item: pytest.Item) -> bool:
    return ((item.get_closest_marker("fault") is not None
             or item.get_closest_marker("group") is not None)
            and not os.environ.get("KILN_FAULTS_ON_EVERY_BACKEND")
            and getattr(item, "callspec", None) is not None
            and item.callspec.params.get("db") == "sqlite")


# The fixtures that reach PostgreSQL, SQLite's migrated file or Redis; every fixture built on
# them (api, ctx, ...) has them in its closure.
_SERVER_FIXTURES = frozenset({"db", "session", "redis_client", "redis_prefix"})
# Packages whose import means a test module starts servers or processes: the test servers and
# service (servers), rank sets (multirank), child processes, an ASGI server, a browser, a local
# S3 server.
_STARTERS = ("servers", "multirank", "subprocess", "multiprocessing", "torch.multiprocessing",
             "uvicorn", "selenium", "moto", "http.server")
# A module that imports Redis's client itself (not just its exception types) talks to Redis,
# with or without the fixtures (through request.getfixturevalue, say).
_CLIENTS = ("redis",)
# What starts rank processes or children when called: launch's rank sets and the renders built
# on them, and child processes.
_STARTER_CALLS = frozenset({"run_ranks", "generate_on_ranks", "generate_in_rounds", "render",
                            "Popen"})
_STARTER_CALL_MODULES = frozenset({"runtime.launch", "runtime.render", "subprocess"})


def _within(module_name: object, packages: tuple[str, ...]) -> bool:
    return isinstance(module_name, str) and any(
        module_name == p or module_name.startswith(p + ".") for p in packages)


def _starts_things(module: types.ModuleType) -> bool:
    for name, value in vars(module).items():
        if isinstance(value, types.ModuleType):
            if _within(value.__name__, _STARTERS + _CLIENTS):
                return True
        else:
            home = getattr(value, "__module__", None)
            if _within(home, _STARTERS) or (home in _STARTER_CALL_MODULES
                                             and name in _STARTER_CALLS):
                return True
    return False


def _is_unit(item: pytest.Item, starters: dict[str, bool]) -> bool:
    if item.get_closest_marker("slow") is not None:
        return False
    if _SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return False
    module = getattr(item, "module", None)
    if module is None:
        return False
    if module.__name__ not in starters:
        starters[module.__name__] = _starts_things(module)
    return not starters[module.__name__]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fault and group scenarios on PostgreSQL only, unless KILN_FAULTS_ON_EVERY_BACKEND is
    set; the slowest scenarios (marked ``chaos``) only with KILN_CHAOS set. Tests that reach no
    server and start no process are marked ``unit``."""
    starters: dict[str, bool] = {}
    for item in items:
        if _is_unit(item, starters):
            item.add_marker(pytest.mark.unit)
    dropped = [item for item in items if _chaos_only(item) or _postgres_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in set(dropped)]


# Programs a unit test may not start: Python (a rank, a CLI, a script) and the service's own
# servers. Short tool calls a library makes (platform's `uname -p`, say) are let through.
_SERVICE_PROGRAMS = ("python", "kiln", "celery", "redis-server", "postgres", "uvicorn")


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request: pytest.FixtureRequest,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the ``unit`` marking honest: a unit test that starts a rank set or one of the
    service's programs fails, naming where what its module imports belongs."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse() -> NoReturn:
        raise RuntimeError(f"{request.node.nodeid} is marked unit but starts a process: what "
                           "its module imports belongs in tests/conftest.py's _STARTERS")

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(popen: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else ""
        if program.startswith(_SERVICE_PROGRAMS):
            refuse()
        return execute_child(popen, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: refuse())


@pytest.fixture(scope="session")
def _sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    path: Path = tmp_path_factory.mktemp("db") / "kiln.db"
    url = f"sqlite:///{path}"
    migrations.upgrade(url)
    engine = make_engine(url)
    yield Database("sqlite", url, engine)
    engine.dispose()


@pytest.fixture(scope="session")
def _postgresql_db() -> Iterator[Database]:
    name = f"kiln_test_{os.getpid()}_{secrets.token_hex(4)}"
    # CREATE/DROP DATABASE run from the "postgres" maintenance database, which always exists.
    admin_url = make_url(POSTGRES_URL).set(database="postgres")
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        _unavailable("PostgreSQL", exc)
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    try:
        migrations.upgrade(url)
        engine = make_engine(url, pool_size=5, max_overflow=5)
        yield Database("postgresql", url, engine)
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> Iterator[Database]:
    """A migrated database on each backend, emptied after the test."""
    database: Database = request.getfixturevalue(f"_{request.param}_db")
    yield database
    tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
    with database.engine.begin() as conn:
        if database.backend == "postgresql":
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        else:
            for table in tables:
                conn.execute(text(f"DELETE FROM {table}"))


@pytest.fixture
def session(db: Database) -> Iterator[Session]:
    with db.session() as s:
        yield s


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        _unavailable("Redis", exc)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test (or run) uses; its keys are deleted after the test."""
    prefix = f"kilntest:{secrets.token_hex(6)}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        redis_client.delete(*keys)
