"""The status dashboard: one static page that polls the JSON API with the user's key.

The page itself needs no key (it holds no data); it asks for one, keeps it in the browser's local
storage, and shows what that key may see: job counts by state, the worker groups with their ranks'
memory and current jobs, the newest batches (counts by state, progress, window, ETA and a link to
the report, from ``GET /v1/batches``) and the latest jobs with progress and thumbnails.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from api.deps import CurrentUser, SessionDep
from storage import stats
from storage.tables import utcnow

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
