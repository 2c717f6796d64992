"""The status dashboard: one static page that polls the JSON API with the user's key.

The page itself needs no key (it holds no data); it asks for one, keeps it in the browser's local
storage, and shows what that key may see: job counts by state, the worker groups with their ranks'
memory and current jobs, the newest batches (counts by state, progress, window, ETA and a link to
the report, from ``GET /v1/batches``) and the latest jobs with progress and thumbnails, each
linking to its job page.

The job page, ``GET /dashboard/jobs/{id}``, is rendered on the server (`api.job_page`) for a
request with a key; without one it is a shell whose script fetches the page again with the
stored key (a browser sends no header when following a link) and swaps the job in. The batch
page, ``GET /dashboard/batches/{id}`` (`api.batch_page`: progress and the morning report), works
the same way.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from api import batch_page, job_page
from api.deps import BearerDep, CurrentUser, SessionDep, get_current_user
from api.routes.jobs import JobId, visible_job
from storage import queries, stats, webhooks, workers
from storage.tables import InputFile, JobState, User, utcnow

router = APIRouter(tags=["dashboard"])

_PAGE = Path(__file__).resolve().parent.parent / "dashboard.html"


# The pages hold user text (prompts, errors, metadata): their Content-Security-Policy
# (api.headers.PAGE_POLICY, added to every HTML answer) lets them run only kiln's own scripts.
_PAGE_HEADERS = {"Cache-Control": "no-store"}


class Failure(BaseModel):
    id: str
    status: str
    model: str
    error: str | None
    error_code: str | None
    finished_at: datetime | None


class Summary(BaseModel):
    """The dashboard's overview. Counts are the caller's jobs (an admin's: everyone's)."""

    viewer: str = Field(description="the key's user")
    is_admin: bool
    jobs_by_state: dict[str, int]
    jobs_by_class: dict[str, dict[str, int]] = Field(description="class -> state -> jobs")
    videos_last_hour: int  # succeeded in the last hour
    videos_per_hour: float | None = Field(
        description="over the last hour, from the first of its videos' start; null: none")
    api_started_at: datetime
    videos_since_start: int = Field(description="succeeded since this API process started")
    videos_per_hour_since_start: float | None
    queue_depth: int = Field(description="queued jobs")
    queue_eta_seconds: float | None = Field(
        description="queue_depth at videos_per_hour; null while nothing finished in the hour")
    failures_last_hour: int = Field(description="failed, dead or expired in the last hour")
    recent_failures: list[Failure] = Field(description="the newest of them, with their reasons")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers=_PAGE_HEADERS)


@router.get("/v1/summary", response_model=Summary)
def summary(request: Request, user: CurrentUser, session: SessionDep) -> Summary:
    """The overview: counts by state and class, throughput, the queue's ETA at that throughput,
    and the last hour's failures."""
    owner = None if user.is_admin else user.id
    now = utcnow()
    hour_ago = now - timedelta(hours=1)
    started: datetime = request.app.state.started_at
    by_class = stats.jobs_by_class_and_state(session, owner)
    by_state: dict[str, int] = {}
    for states in by_class.values():
        for state, n in states.items():
            by_state[state] = by_state.get(state, 0) + n
    last_hour, rate = stats.throughput_since(session, hour_ago, now, owner)
    since_start, rate_since_start = stats.throughput_since(session, started, now, owner)
    depth = by_state.get(JobState.QUEUED.value, 0)
    failed, newest = stats.recent_failures(session, hour_ago, owner)
    session.commit()  # ends the read transaction
    return Summary(
        viewer=user.name, is_admin=user.is_admin, jobs_by_state=by_state,
        jobs_by_class=by_class, videos_last_hour=last_hour,
        videos_per_hour=rate, api_started_at=started, videos_since_start=since_start,
        videos_per_hour_since_start=rate_since_start, queue_depth=depth,
        queue_eta_seconds=3600 * depth / rate if rate else None,
        failures_last_hour=failed,
        recent_failures=[Failure(id=j.id, status=j.state, model=j.model, error=j.error,
                                 error_code=j.error_code, finished_at=j.finished_at)
                         for j in newest])


async def _optional_user(request: Request, credentials: BearerDep,
                         session: SessionDep) -> User | None:
    if not request.headers.get("authorization"):
        return None
    return await get_current_user(request, credentials, session)


@router.get("/dashboard/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
async def job_detail_page(
    job_id: JobId,
    session: SessionDep,
    user: Annotated[User | None, Depends(_optional_user)],
) -> HTMLResponse:
    """With a key: the job's page (404 for a job the key may not see). Without one: the shell
    that loads it with the key kept in the browser."""
    if user is None:
        return HTMLResponse(job_page.page(None, job_id), headers=_PAGE_HEADERS)
    main = await run_in_threadpool(_render_job, session, job_id, user)
    return HTMLResponse(job_page.page(main, job_id), headers=_PAGE_HEADERS)


def _render_job(session: Session, job_id: str, user: User) -> str:
    job = visible_job(session, job_id, user)
    events = queries.job_events(session, job.id)
    groups = sorted({str(e.detail.get("worker_group_id")) for e in events
                     if e.kind == "claimed" and (e.detail or {}).get("worker_group_id")})
    names = workers.group_names(session, groups)
    owner = None
    if user.is_admin:
        row = session.get(User, job.owner_id)
        owner = row.name if row else None
    deliveries = webhooks.delivery_log(session, job.id) if job.webhook_url else None
    input_file = session.get(InputFile, job.input_file_id) if job.input_file_id else None
    main = job_page.render_main(job, events, names, owner=owner, deliveries=deliveries,
                                input_file=input_file,
                                adapter_names=job_page.adapter_names(session, job))
    session.commit()  # ends the read transaction in this thread
    return main


@router.get("/dashboard/batches/{batch_id}", response_class=HTMLResponse,
            include_in_schema=False)
async def batch_detail_page(
    batch_id: str,
    session: SessionDep,
    user: Annotated[User | None, Depends(_optional_user)],
) -> HTMLResponse:
    """With a key: the batch's page and morning report (404 for a batch the key may not see).
    Without one: the shell that loads it with the key kept in the browser."""
    if user is None:
        return HTMLResponse(batch_page.page(None, batch_id), headers=_PAGE_HEADERS)
    main = await run_in_threadpool(batch_page.load_main, session, batch_id, user)
    return HTMLResponse(batch_page.page(main, batch_id), headers=_PAGE_HEADERS)


class _Assets(StaticFiles):
    """The pages' scripts and stylesheet (the ``.js`` and ``.css`` files of ``api/assets``;
    nothing else there is served), checked again at every load (``no-cache``: a new release's
    script is picked up at once, and the ETag spares the transfer until then)."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        missing = HTTPException(status.HTTP_404_NOT_FOUND, f"no asset named {path[:60]!r}")
        if PurePosixPath(path).suffix not in (".js", ".css"):
            raise missing
        try:
            response = await super().get_response(path, scope)
        except StarletteHTTPException as exc:
            if exc.status_code == status.HTTP_404_NOT_FOUND:
                raise missing from None
            raise
        response.headers["Cache-Control"] = "no-cache"
        return response


# Mounted by `api.app` at ASSETS_PATH: /dashboard/assets/kiln.css, /dashboard/assets/page.js, ...
ASSETS_PATH = "/dashboard/assets"
assets = _Assets(directory=Path(__file__).resolve().parent.parent / "assets")
