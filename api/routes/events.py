"""``GET /v1/events``: server-sent events of job state changes, progress, worker groups and
batches (`api.events`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import events
from api.deps import StreamUser, get_stream_user

router = APIRouter(tags=["events"])


def _cursor(value: str | None, name: str) -> int | None:
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit() or len(value.strip()) > 19:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"{name}: must be an event id (a whole number), got {value[:40]!r}")
    return int(value.strip())


@router.get(
    "/v1/events", response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "An endless stream of server-sent events"},
               503: {"description": "The database is unreachable; see Retry-After"}})
async def event_stream(
    request: Request,
    caller: Annotated[StreamUser, Depends(get_stream_user)],
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=40)] = None,
    after: Annotated[str | None, Query(
        max_length=40, description="Resume after this event id, as Last-Event-ID does (for a "
        "first connection, which cannot send that header)")] = None,
) -> StreamingResponse:
    """Job state changes, progress of running jobs, worker group changes and batch progress, as
    ``text/event-stream``. Each message's ``data`` is a JSON object with a ``type`` (``job``,
    ``progress``, ``worker_group``, ``batch``); its ``id`` resumes the stream (``Last-Event-ID``).
    A comment is sent every ``events_heartbeat_seconds``. The key is checked again every
    ``api_key_cache_seconds``: the stream of a key revoked meanwhile ends with a comment that
    says so."""
    resume = _cursor(last_event_id, "Last-Event-ID")
    if resume is None:
        resume = _cursor(after, "after")
    app = request.app
    stream = events.EventStream(app.state.session_factory, app.state.settings, caller.user,
                                resume, key=caller.key)
    # The first poll runs before the response starts: a database that is out is a 503 here.
    first, more = await run_in_threadpool(stream.poll)
    return StreamingResponse(
        events.stream(stream, first, more, app.state.event_streams),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
