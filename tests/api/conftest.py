"""An API app on each database backend with real Redis, and three users: alice, bob, root."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.app import create_app
from common.settings import Settings
from storage import lifecycle
from storage.outputs import LocalStore, thumbnail_key, video_key
from storage.tables import Base, Job
from storage.users import create_api_key


@dataclass
class Api:
    app: FastAPI
    client: TestClient
    settings: Settings
    db: object  # tests.conftest.Database
    redis: redis.Redis
    store: LocalStore
    keys: dict[str, str]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def session(self) -> Session:
        return self.db.session()  # type: ignore[attr-defined]

    def snapshot(self) -> dict[str, object]:
        """Row counts of every table plus every job's state: what a refused request must not
        change."""
        with self.session() as s:
            counts = {t.name: s.scalar(select(func.count()).select_from(t))
                      for t in Base.metadata.sorted_tables}
            rows = s.execute(select(Job.id, Job.state, Job.cancel_requested, Job.attempts,
                                    Job.deleted_at))
            states = sorted(tuple(r) for r in rows)
        return {"counts": counts, "jobs": states}

    def finish(self, job_id: str, video: bytes = b"mp4", thumb: bytes = b"png",
               **fields: object) -> None:
        """Finish a job the way a worker would -- guarded claim and finish through the
        repository, outputs through LocalStore -- without rendering anything; ``fields``: what
        the worker says of the attempt (`lifecycle.finish_succeeded`'s ``has_audio``, ...)."""
        with self.session() as s:
            claim = lifecycle.claim_job(s, job_id, worker_group_id="test-group", rank=0,
                                        lease_seconds=60)
            assert claim is not None
            self.store.put_bytes(video_key(job_id), video)
            self.store.put_bytes(thumbnail_key(job_id), thumb)
            assert lifecycle.finish_succeeded(s, job_id, claim.attempt_token,
                                              video_key=video_key(job_id),
                                              thumbnail_key=thumbnail_key(job_id),
                                              **fields)


def make_settings(db_url: str, prefix: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = dict(
        database_url=db_url, redis_url="redis://unused", redis_prefix=prefix,
        output_dir=tmp_path / "outputs", models=["kiln-tiny", "kiln-big"],
        max_queued_jobs_per_user=5, max_body_bytes=16 * 1024, max_prompt_chars=500,
        reconcile_interval_seconds=3600,
    )
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


@pytest.fixture
def api(db, redis_client: redis.Redis, redis_prefix: str, tmp_path: Path) -> Iterator[Api]:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    store = LocalStore(settings.output_dir)
    app = create_app(settings, engine=db.engine, redis=redis_client, store=store)
    with db.session() as s:
        keys = {"alice": create_api_key(s, "alice").key, "bob": create_api_key(s, "bob").key,
                "root": create_api_key(s, "root", is_admin=True).key}
    with TestClient(app, raise_server_exceptions=True) as client:
        yield Api(app, client, settings, db, redis_client, store, keys)
