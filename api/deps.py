"""FastAPI dependencies: the request's database session, the authenticated user, shared clients."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.jobs import QueueRoom
from common.settings import Settings
from storage.outputs import OutputStore
from storage.tables import User
from storage.users import authenticate, hash_key


# Coroutines, not plain functions: FastAPI would run those in the thread pool, one hop each.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_db(request: Request) -> AsyncIterator[Session]:
    # Making a Session does no I/O (it connects on first use, in the route's thread), so this
    # runs on the event loop instead of costing two thread-pool hops per request.
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        # Closing a session whose transaction is still open rolls it back on the server, so
        # that runs in the thread pool; most requests have committed (or never queried), and
        # closing such a session does no I/O: that runs here, one thread-pool hop fewer.
        if session.in_transaction():
            # Not on the routes' thread limiter: this session holds a connection until it
            # closes, and routes waiting for a connection must never hold every thread.
            await anyio.to_thread.run_sync(session.close, limiter=_close_limiter(request))
        else:
            session.close()


def _close_limiter(request: Request) -> anyio.CapacityLimiter:
    limiter = getattr(request.app.state, "close_limiter", None)
    if limiter is None:  # made on the event loop, at first use
        limiter = request.app.state.close_limiter = anyio.CapacityLimiter(8)
    return limiter


async def get_redis(request: Request) -> Redis:
    return request.app.state.redis


async def get_store(request: Request) -> OutputStore:
    return request.app.state.store


async def get_queue_room(request: Request) -> QueueRoom:
    return request.app.state.queue_room


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_db)]
RedisDep = Annotated[Redis, Depends(get_redis)]
StoreDep = Annotated[OutputStore, Depends(get_store)]
QueueRoomDep = Annotated[QueueRoom, Depends(get_queue_room)]


def _unauthorized(reason: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, reason, headers={"WWW-Authenticate": "Bearer"}
    )


# The OpenAPI document's security scheme: every route that depends on it declares
# ``security: [{"HTTPBearer": []}]``, and Swagger UI's Authorize button sends the key with every
# "Try it out". It raises nothing (``auto_error=False``): `bearer_key` answers with kiln's own
# 401s, which say what is wrong with the header.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API key (`kiln keys create`), sent as 'Authorization: Bearer <key>'.")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def bearer_key(request: Request, credentials: HTTPAuthorizationCredentials | None) -> str:
    """The key of the request's ``Authorization: Bearer`` header (``credentials``, as
    `bearer_scheme` parsed it); 401 without one."""
    if not request.headers.get("authorization"):
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if credentials is None:  # another scheme, or no key after "Bearer"
        raise _unauthorized("Authorization must be 'Bearer <key>'")
    return credentials.credentials


async def get_current_user(request: Request, credentials: BearerDep,
                           session: SessionDep) -> User:
    # A coroutine: a key found in the cache (most requests) costs no thread-pool hop; only
    # the lookup of a new key goes to the pool.
    return await _user_for_key(request, bearer_key(request, credentials), session)


async def _user_for_key(request: Request, key: str, session: Session | None) -> User:
    """The key's user, from the cache or (in the thread pool) the database; ``session`` None:
    a session of its own, closed before this returns."""
    cache: KeyCache = request.app.state.key_cache
    cached = cache.get(key)
    if cached is not None:
        return cached
    if session is None:
        user = await run_in_threadpool(_authenticate_alone, request.app.state.session_factory,
                                       key)
    else:
        user = await run_in_threadpool(_authenticate, session, key)
    if user is None:
        raise _unauthorized("invalid or revoked API key")
    cache.put(key, user)
    return user


async def get_stream_user(request: Request, credentials: BearerDep) -> StreamUser:
    """The user of a long-lived stream (``GET /v1/events``), by the Bearer key like every other
    route, and the key itself: the stream checks it again while it runs (a revoked key's stream
    ends). It holds no session: the stream must not keep a database connection.

    A key in the query string is refused (400): a URL ends up in access logs, proxies' logs and
    browser history."""
    if "key" in request.query_params:
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            "the API key goes in the header 'Authorization: Bearer <key>', not "
                            "in the URL (a URL is logged)")
    key = bearer_key(request, credentials)
    return StreamUser(await _user_for_key(request, key, None), key)


@dataclass(frozen=True, slots=True)
class StreamUser:
    user: User
    key: str  # checked again every api_key_cache_seconds while the stream is open


def _authenticate_alone(session_factory: Any, key: str) -> User | None:
    with session_factory() as session:
        user = authenticate(session, key)
        if user is not None:
            session.expunge(user)
        return user


def _authenticate(session: Session, key: str) -> User | None:
    user = authenticate(session, key)
    # End the read transaction here: between this thread and the route's, the session must not
    # hold a connection (with every thread waiting for one, nothing would give one back).
    session.commit()
    return user


class KeyCache:
    """Keys that authenticated in the last ``ttl_seconds``, so most requests skip the lookup
    query. The cost: a revoked key keeps working for up to ``ttl_seconds`` (0 disables).

    It returns a fresh, session-less `User` each time: sharing one ORM object between requests'
    sessions would let one request's rollback expire it under another.
    """

    def __init__(self, ttl_seconds: float, max_entries: int = 10_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, int, str, bool]] = {}

    def get(self, key: str) -> User | None:
        entry = self._entries.get(hash_key(key))
        if entry is None or entry[0] < time.monotonic():
            return None
        _, user_id, name, is_admin = entry
        return User(id=user_id, name=name, is_admin=is_admin, disabled=False)

    def clear(self) -> None:
        self._entries.clear()

    def put(self, key: str, user: User) -> None:
        if self.ttl_seconds <= 0:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # crude, but bounded; the next requests refill it
        expires = time.monotonic() + self.ttl_seconds
        self._entries[hash_key(key)] = (expires, user.id, user.name, user.is_admin)


CurrentUser = Annotated[User, Depends(get_current_user)]
