"""The FastAPI application factory.

At startup (and then every ``reconcile_interval_seconds``) the Redis queue index is reconciled
with the database, so a Redis restart or flush loses no queued job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib.metadata import version

from fastapi import FastAPI
from redis import Redis, RedisError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from api import uploads
from api.deps import KeyCache
from api.errors import BodySizeLimit, install_error_handlers
from api.events import StreamCount
from api.headers import SecurityHeaders, page_policy, store_origin
from api.jobs import QueueRoom
from api.metrics import make_registry
from api.routes import (
    adapters,
    batches,
    dashboard,
    docs,
    events,
    files,
    jobs,
    models,
    system,
    videos,
    webhook_secret,
)
from common.settings import Settings, get_settings
from scheduler import queue_index
from storage.db import make_engine, make_session_factory
from storage.outputs import OutputStore, make_store
from storage.tables import utcnow

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    redis: Redis | None = None,
    store: OutputStore | None = None,
) -> FastAPI:
    """The API for ``settings``; ``engine``, ``redis`` and ``store`` replace the ones the settings
    would make (tests pass their own)."""
    if redis is None:
        if settings.redis_url is None:
            raise ValueError("no Redis configured: set REDIS_URL (kiln up starts one for you)")
        redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5,
                               health_check_interval=30)
    engine = engine if engine is not None else make_engine(settings.database_url)
    session_factory = make_session_factory(engine)

    def reconcile() -> None:
        try:
            with session_factory() as session:
                result = queue_index.reconcile(session, redis, settings.redis_prefix)
            log.info("queue index reconciled: %d missing added, %d stale removed", result.added,
                     result.removed)
        except (RedisError, SQLAlchemyError):
            log.warning("queue index reconciliation failed; retrying later", exc_info=True)

    async def reconcile_forever() -> None:
        while True:
            await asyncio.sleep(settings.reconcile_interval_seconds)
            await run_in_threadpool(reconcile)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(reconcile)
        task = asyncio.create_task(reconcile_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(
        title="kiln",
        version=version("kiln"),
        summary="Batch video rendering with diffusion transformers bigger than one accelerator.",
        lifespan=lifespan,
        # /docs is api.routes.docs (Swagger UI under a policy of its own); no ReDoc.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.redis = redis
    app.state.store = store if store is not None else make_store(settings)
    app.state.registry = make_registry(session_factory, settings)
    app.state.reconcile = reconcile
    app.state.key_cache = KeyCache(settings.api_key_cache_seconds)
    app.state.queue_room = QueueRoom()
    app.state.event_streams = StreamCount()
    app.state.started_at = utcnow()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       per_path={"/v1/batches": settings.max_batch_body_bytes,
                                 "/v1/files": uploads.body_limit(settings),
                                 "/v1/adapters": uploads.body_limit(settings),
                                 "/v1/videos": uploads.body_limit(settings),
                                 "/v1/videos/edits": uploads.body_limit(settings),
                                 "/v1/videos/extensions": uploads.body_limit(settings)})
    # Outermost, so that the size limit's own refusals carry the headers too.
    app.add_middleware(SecurityHeaders, policy=page_policy(store_origin(app.state.store)))
    app.include_router(jobs.router)
    app.include_router(batches.router)
    app.include_router(videos.router)
    app.include_router(system.router)
    app.include_router(dashboard.router)
    app.mount(dashboard.ASSETS_PATH, dashboard.assets, name="assets")
    app.include_router(events.router)
    app.include_router(models.router)
    app.include_router(docs.router)
    app.include_router(files.router)
    app.include_router(adapters.router)
    app.include_router(webhook_secret.router)
    return app


def app_from_env() -> FastAPI:
    """Uvicorn factory (``kiln api``): the app for the environment's settings."""
    return create_app(get_settings())
