"""API keys, the Redis queue index, output stores and the migrations themselves."""

from __future__ import annotations

import os
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, make_url, select, text
from sqlalchemy.orm import Session

import migrations
from scheduler import queue_index
from storage import lifecycle, queries, submission
from storage.outputs import LocalStore, thumbnail_key, video_key
from storage.submission import JobSpec
from storage.tables import ApiKey, Base, JobClass
from storage.users import authenticate, create_api_key, revoke_api_key

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
POSTGRES_URL = os.environ.get(
    "KILN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(model="kiln-tiny", prompt="p", width=64, height=64,
                                   num_frames=9, fps=8, num_inference_steps=4,
                                   guidance_scale=5.0, seed=0)
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_api_keys_are_stored_hashed_and_authenticate_until_revoked(session: Session) -> None:
    new = create_api_key(session, "alice")
    stored = session.scalar(select(ApiKey))
    assert stored is not None and stored.key_hash != new.key and new.key not in stored.key_hash
    assert len(stored.key_hash) == 64 and new.key.startswith("kiln_" + new.prefix)
    user = authenticate(session, new.key)
    assert user is not None and user.name == "alice" and not user.is_admin
    assert authenticate(session, new.key[:-1] + ("A" if new.key[-1] != "A" else "B")) is None
    assert authenticate(session, "kiln_short") is None
    assert authenticate(session, "") is None
    assert revoke_api_key(session, new.prefix)
    assert authenticate(session, new.key) is None


def test_ready_index_is_rebuilt_after_its_keys_are_flushed(
    session: Session, redis_client: redis.Redis, redis_prefix: str
) -> None:
    alice = create_api_key(session, "alice").user
    made = [
        submission.create_job(session, alice, _spec(priority=p, job_class=c), request_hash=str(i),
                              now=T0 + timedelta(seconds=i)).job
        for i, (p, c) in enumerate([(5, JobClass.INTERACTIVE), (9, JobClass.BATCH),
                                    (5, JobClass.INTERACTIVE)])
    ]
    queue_index.add(redis_client, redis_prefix, made)
    first = ready_key = queue_index.ready_key(redis_prefix, "interactive", 5)
    assert [m.decode() for m in redis_client.zrange(first, 0, -1)] == [made[0].id, made[2].id]

    # Redis loses every kiln key; nothing is lost because the database is the truth.
    redis_client.delete(*redis_client.scan_iter(match=f"{redis_prefix}*"))
    # A job that is no longer queued left a stale entry in a surviving index.
    lifecycle.request_cancel(session, made[2].id, alice)
    redis_client.zadd(ready_key, {made[2].id: 1.0})
    result = queue_index.reconcile(session, redis_client, redis_prefix)
    assert (result.added, result.removed) == (2, 1)
    assert [m.decode() for m in redis_client.zrange(ready_key, 0, -1)] == [made[0].id]
    batch_key = queue_index.ready_key(redis_prefix, "batch", 9)
    assert redis_client.zscore(batch_key, made[1].id) == pytest.approx((T0 + timedelta(
        seconds=1)).timestamp())
    # The serving order: interactive 9..0 first, then batch.
    keys = queue_index.ready_keys(redis_prefix)
    assert keys[0].endswith("interactive:9") and keys[10].endswith("batch:9") and len(keys) == 20


def test_ready_score_is_not_before_so_future_jobs_are_not_yet_due(session: Session) -> None:
    alice = create_api_key(session, "alice").user
    later = submission.create_job(session, alice, _spec(not_before=T0 + timedelta(hours=2)),
                                  request_hash="x", now=T0).job
    assert queue_index.due(later) == (T0 + timedelta(hours=2)).timestamp()


def test_local_store_writes_atomically_under_job_id_keys(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    src = tmp_path / "video.mp4"
    src.write_bytes(b"\x00mp4 bytes")
    key = video_key("abcdefghij0123456789")
    store.put(key, src)
    assert key == "videos/abcdefghij0123456789.mp4"
    with store.open(key) as f:
        assert f.read() == b"\x00mp4 bytes"
    assert store.exists(key) and store.url(key) is None
    assert list((tmp_path / "out" / "videos").iterdir()) == [tmp_path / "out" / key]
    store.put_bytes(thumbnail_key("abcdefghij0123456789"), b"jpg")
    store.delete(key)
    store.delete(key)  # absent is fine
    assert not store.exists(key)
    for bad in ["../etc/passwd", "videos/../../x.mp4", "/abs/x.mp4", "videos/A B.mp4"]:
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"")
    with pytest.raises(ValueError):
        video_key("../../etc")


def _fresh_database(backend: str, tmp_path: Path) -> tuple[str, object]:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}", None
    name = f"kiln_mig_{os.getpid()}_{secrets.token_hex(4)}"
    admin = create_engine(make_url(POSTGRES_URL).set(database="postgres"),
                          isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(POSTGRES_URL).set(database=name).render_as_string(False), (admin, name)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migrations_build_the_models_schema_and_downgrade_to_nothing(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(f"_{backend}_db")  # skips (or fails under CI) without the server
    url, cleanup = _fresh_database(backend, tmp_path)
    try:
        migrations.upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            assert diff == []
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            assert (version,) == migrations.current_heads()
        migrations.downgrade(url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        migrations.upgrade(url)
        assert {"jobs", "users", "api_keys", "batches", "worker_groups", "job_events"} <= set(
            inspect(engine).get_table_names())
        engine.dispose()
    finally:
        if cleanup is not None:
            admin, name = cleanup  # type: ignore[misc]
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def test_index_position_agrees_with_the_database_count(
    session: Session, redis_client: redis.Redis, redis_prefix: str
) -> None:
    alice = create_api_key(session, "alice").user
    made = [
        submission.create_job(session, alice, _spec(priority=p, job_class=c), request_hash=str(i),
                              now=T0 + timedelta(seconds=i)).job
        for i, (p, c) in enumerate([(5, JobClass.BATCH), (5, JobClass.INTERACTIVE),
                                    (9, JobClass.INTERACTIVE), (5, JobClass.INTERACTIVE)])
    ]
    queue_index.add(redis_client, redis_prefix, made)
    from_index = [queue_index.position(redis_client, redis_prefix, j) for j in made]
    assert from_index == [queries.queue_position(session, j) for j in made] == [3, 1, 0, 2]
    lifecycle.request_cancel(session, made[2].id, alice)
    queue_index.remove(redis_client, redis_prefix, [made[2].id])
    assert queue_index.position(redis_client, redis_prefix, made[2]) is None
    assert queue_index.position(redis_client, redis_prefix, made[1]) == 0
