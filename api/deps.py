"""FastAPI dependencies: the request's database session, the authenticated user, shared clients."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from redis import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from kiln.settings import Settings
from storage.models import User
from storage.outputs import OutputStore
from storage.users import authenticate


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
        await run_in_threadpool(session.close)


async def get_redis(request: Request) -> Redis:
    return request.app.state.redis


async def get_store(request: Request) -> OutputStore:
    return request.app.state.store


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_db)]
RedisDep = Annotated[Redis, Depends(get_redis)]
StoreDep = Annotated[OutputStore, Depends(get_store)]


def _unauthorized(reason: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, reason, headers={"WWW-Authenticate": "Bearer"}
    )


def get_current_user(request: Request, session: SessionDep) -> User:
    header = request.headers.get("authorization")
    if not header:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("Authorization must be 'Bearer <key>'")
    user = authenticate(session, key.strip())
    if user is None:
        raise _unauthorized("invalid or revoked API key")
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]
