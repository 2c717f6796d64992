"""A task `Context` on each database backend with real Redis and a local output store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from task_helpers import make_settings

from kiln.tasks import Context
from storage.outputs import LocalStore


@pytest.fixture
def ctx(db: Any, redis_client: redis.Redis, redis_prefix: str,
        tmp_path: Path) -> Iterator[Context]:
    settings = make_settings(db.url, redis_prefix, tmp_path)
    yield Context(settings=settings, sessions=db.session, redis=redis_client,  # type: ignore[arg-type]
                  store=LocalStore(settings.output_dir))
