"""The status dashboard: one static page that polls the JSON API with the user's key.

The page itself needs no key (it holds no data); it asks for one, keeps it in the browser's local
storage, and shows what that key may see: job counts by state, the worker groups with their ranks'
memory and current jobs, the newest batches (counts by state, progress, window, ETA and a link to
the report, from ``GET /v1/batches``) and the latest jobs with progress and thumbnails, each
linking to its job page.

The job page, ``GET /dashboard/jobs/{id}``, is rendered on the server (`api.job_page`) for a
request with a key; without one it is a shell whose script fetches the page again with the
stored key (a browser sends no header when following a link) and swaps the job in.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import job_page
from api.deps import CurrentUser, SessionDep, get_current_user
from api.routes.jobs import JobId, visible_job
from storage import queries, stats, workers
from storage.tables import User, utcnow

router = APIRouter(tags=["dashboard"])

_PAGE = Path(__file__).resolve().parent.parent / "dashboard.html"


class Summary(BaseModel):
    jobs_by_state: dict[str, int]  # the caller's jobs (an admin's: everyone's)
    videos_last_hour: int  # the caller's (an admin's: everyone's) succeeded in the last hour


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"))


@router.get("/v1/summary", response_model=Summary)
def summary(user: CurrentUser, session: SessionDep) -> Summary:
    """Counts for the dashboard header."""
    owner = None if user.is_admin else user.id
    since = utcnow() - timedelta(hours=1)
    return Summary(jobs_by_state=stats.jobs_by_state(session, owner),
                   videos_last_hour=stats.videos_finished_since(session, since, owner))


# The page holds user text (prompts, errors, metadata): it runs only kiln's own script.
_PAGE_HEADERS = {"Content-Security-Policy": "script-src 'self'; object-src 'none'; "
                                            "base-uri 'none'; frame-ancestors 'none'",
                 "Cache-Control": "no-store"}


async def _optional_user(request: Request, session: SessionDep) -> User | None:
    if not request.headers.get("authorization"):
        return None
    return await get_current_user(request, session)


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
    main = job_page.render_main(job, events, names, owner=owner)
    session.commit()  # ends the read transaction in this thread
    return main


_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_ASSET_TYPES = {".js": "text/javascript", ".css": "text/css"}
# The pages' scripts and stylesheet, by name: nothing else under the folder is served.
_ASSET_FILES = {p.name: p for p in _ASSETS.iterdir() if p.suffix in _ASSET_TYPES}


@router.get("/dashboard/assets/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    path = _ASSET_FILES.get(name)
    if path is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no asset named {name[:60]!r}")
    return FileResponse(path, media_type=_ASSET_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})
