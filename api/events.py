"""The live event stream behind ``GET /v1/events``: server-sent events of what a key may see.

Each stream polls the database every ``events_poll_seconds`` in the thread pool, one short read
with a session of its own that is closed before the next sleep (no connection is held between
polls), and sends:

- ``job``: a row of ``job_events`` (a state change: created, claimed, requeued, succeeded, ...),
  in id order, of the caller's jobs (an admin's: everyone's);
- ``progress``: a running job's step, when it changed, at most once per poll per job;
- ``worker_group``: a group that appeared or whose state, reason or staleness changed (every
  group at the start of a stream; groups are no one's, as in ``GET /v1/workers``);
- ``batch``: a batch's counts and progress, after one of its jobs changed state.

The stream checks its key again every ``api_key_cache_seconds`` (in the poll that falls due, on
the poll's own session) and ends, with a comment that says why, once the key no longer
authenticates: a revoked key's open streams end within the same bound as its other requests.

Every message has an ``id:``, the job-event cursor (`storage.feed.EventCursor.watermark`), so a
reconnect with ``Last-Event-ID`` resumes after the job events already delivered; progress, group
and batch messages are snapshots, sent again as they change. ``data:`` is one JSON object whose
``type`` says which of the above it is.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
from fastapi.encoders import jsonable_encoder
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api import batches as batch_views
from common.settings import Settings
from storage import feed
from storage.outages import is_database_outage
from storage.tables import Batch, User, utcnow
from storage.users import authenticate

log = logging.getLogger(__name__)

PAGE = 500  # job events read per poll; a full page is followed by the next poll at once
RETRY_MS = 2000  # how soon a browser reconnects after the stream ends


def message(event_id: int, data: dict[str, Any]) -> str:
    body = json.dumps(jsonable_encoder(data), separators=(",", ":"))
    return f"id: {event_id}\ndata: {body}\n\n"


class EventStream:
    """One client's stream: its cursor and what it has been told so far."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings, user: User,
                 after: int | None, *, key: str) -> None:
        self.session_factory = session_factory
        self.settings = settings
        self.user = user
        self._key = key
        # Checks fall on polls, so one is due a poll early: a revoked key's stream ends within
        # api_key_cache_seconds, as its other requests do.
        self.key_check_seconds = max(
            settings.api_key_cache_seconds - settings.events_poll_seconds, 0.0)
        self.key_checked_at = time.monotonic()  # the request's own check, just made
        self.revoked = False  # the key no longer authenticates: the stream ends
        self.cursor = None if after is None else feed.EventCursor(after)
        self.progress: dict[str, tuple[int, int]] = {}  # job id -> (step, total) last sent
        self.groups: dict[str, tuple[Any, ...]] = {}  # group id -> what was last sent of it

    def poll(self) -> tuple[list[str], bool]:
        """(the messages that are due, whether more job events are waiting); in a thread.
        Nothing, and `revoked` set, once the key no longer authenticates."""
        with self.session_factory() as session:
            if time.monotonic() - self.key_checked_at >= self.key_check_seconds:
                if not self._check_key(session):
                    return [], False
            if self.cursor is None:  # a new stream starts from now
                self.cursor = feed.EventCursor(feed.last_event_id(session))
            out: list[str] = []
            high = self.cursor.high
            events = feed.events_after(session, self.cursor, limit=PAGE)
            touched: set[str] = set()
            for event in events:
                self.cursor.saw(event.id)
                if not (self.user.is_admin or event.owner_id == self.user.id):
                    continue
                if event.batch_id is not None:
                    touched.add(event.batch_id)
                out.append(message(self.cursor.watermark, {
                    "type": "job", "event_id": event.id, "job_id": event.job_id,
                    "kind": event.kind, "status": feed.STATE_AFTER.get(event.kind),
                    "attempt": event.attempt, "at": event.at, "detail": event.detail,
                    "batch_id": event.batch_id}))
            self.cursor.settle(time.monotonic())
            out += self._progress(session)
            out += self._groups(session)
            out += self._batches(session, touched)
            more = sum(1 for e in events if e.id > high) >= PAGE
        return out, more

    def _check_key(self, session: Session) -> bool:
        user = authenticate(session, self._key)
        self.key_checked_at = time.monotonic()
        if user is None:
            self.revoked = True
            return False
        # A fresh, session-less copy (as api.deps.KeyCache gives): an admin demoted meanwhile
        # sees only their own jobs from here on.
        self.user = User(id=user.id, name=user.name, is_admin=user.is_admin, disabled=False)
        return True

    def _progress(self, session: Session) -> list[str]:
        out = []
        now = {p.job_id: p for p in feed.running_progress(session, self.user)}
        for job_id, p in now.items():
            if self.progress.get(job_id) == (p.step, p.total_steps):
                continue
            self.progress[job_id] = (p.step, p.total_steps)
            out.append(message(self._id(), {
                "type": "progress", "job_id": job_id, "step": p.step,
                "total_steps": p.total_steps, "batch_id": p.batch_id,
                "progress": round(p.step / p.total_steps, 4) if p.total_steps else 0.0}))
        for gone in self.progress.keys() - now.keys():  # ended: its job event says how
            del self.progress[gone]
        return out

    def _groups(self, session: Session) -> list[str]:
        out = []
        stale_before = utcnow().timestamp() - self.settings.worker_stale_seconds
        for g in feed.worker_groups(session, self.groups):
            stale = g.heartbeat_at.timestamp() < stale_before
            seen = (g.state, g.state_reason, stale, g.dp_size, g.world_size)
            if self.groups.get(g.id) == seen:
                continue
            self.groups[g.id] = seen
            out.append(message(self._id(), {
                "type": "worker_group", "id": g.id, "name": g.name, "host": g.host,
                "model": g.model, "mode": g.mode, "state": g.state, "reason": g.state_reason,
                "stale": stale, "dp_size": g.dp_size, "world_size": g.world_size,
                "heartbeat_at": g.heartbeat_at}))
            if g.state == "stopped":
                del self.groups[g.id]  # told once; not asked about again
        return out

    def _batches(self, session: Session, batch_ids: set[str]) -> list[str]:
        if not batch_ids:
            return []
        rows = list(session.scalars(select(Batch).where(Batch.id.in_(sorted(batch_ids)))))
        return [message(self._id(), {"type": "batch",
                                     **b.model_dump(mode="json", exclude={"object"})})
                for b in batch_views.details(session, self.user, rows)]

    def _id(self) -> int:
        assert self.cursor is not None
        return self.cursor.watermark


async def stream(events: EventStream, first: list[str], more: bool,
                 streams: StreamCount) -> AsyncIterator[str]:
    """The response body: ``first`` (the poll made before the response started, so an outage
    then is a 503), then a poll every interval and a keep-alive comment every heartbeat, until
    the client goes (Starlette cancels this at the next await) or the database does."""
    poll_seconds = events.settings.events_poll_seconds
    heartbeat_seconds = events.settings.events_heartbeat_seconds
    streams.open += 1
    try:
        yield f"retry: {RETRY_MS}\n\n" + "".join(first)
        next_beat = time.monotonic() + heartbeat_seconds
        while True:
            if not more:
                await anyio.sleep(poll_seconds)
            try:
                messages, more = await anyio.to_thread.run_sync(events.poll)
            except Exception as exc:
                if not is_database_outage(exc):
                    raise
                log.warning("event stream ended: the database is unreachable (%s)",
                            type(exc).__name__)
                yield ": the database is unreachable; reconnect later\n\n"
                return
            if events.revoked:
                yield ": the API key was revoked (or its user disabled); the stream ends\n\n"
                return
            if time.monotonic() >= next_beat:
                messages.append(": keep-alive\n\n")
                next_beat = time.monotonic() + heartbeat_seconds
            if messages:
                yield "".join(messages)
    finally:
        streams.open -= 1


class StreamCount:
    """How many event streams this API process has open."""

    def __init__(self) -> None:
        self.open = 0
