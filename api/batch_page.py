"""The batch page (``GET /dashboard/batches/{id}``), rendered on the server: where the batch
stands (status, window, progress, counts, ETA) and its morning report (the jobs that ended and
how, each problem's reason, throughput, render time, every job linking to its page).

The figures are `api.batches`' own (`BatchPublic`, `BatchReport`), so the page and
``GET /v1/batches/{id}/report`` never disagree. The HTML is ``templates/batch.html``, where
every piece of user text is escaped (autoescape, see `api.pages`). The scripts
(``assets/kiln.js``, ``page.js`` and ``batch_page.js``) load it with the stored key and reload it
when one of its jobs changes.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from api import batches as batch_views
from api import pages
from api.schemas import BatchPublic, BatchReport, BatchReportJob
from storage import batches, feed
from storage.tables import JobState, User

# Rows in the jobs table: a page reloaded at every change of a huge batch stays small; the
# problems are listed in full above it, and the report route has every job.
MAX_JOB_ROWS = 500
_FINAL = ("succeeded", "failed", "expired", "cancelled", "dead")


def load_main(session: Session, batch_id: str, user: User) -> str:
    """The ``<main>`` for ``batch_id``; 404 when ``user`` may not see it."""
    batch = batches.get_batch(session, batch_id, user)
    if batch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "batch not found")
    public = batch_views.detail(session, user, batch)
    report = batch_views.report(session, batch)
    last_event = feed.last_event_id(session)
    session.commit()  # ends the read transaction in this thread
    return render_main(public, report, last_event=last_event)


# Jobs named per reason: a reason shared by a thousand expired jobs is one row, not a thousand.
EXAMPLES_PER_REASON = 5


def _problem_groups(report: BatchReport) -> list[list[BatchReportJob]]:
    """The problems grouped by state and reason (error code and message), most common first."""
    groups: dict[tuple[str, tuple[str, str] | None], list[BatchReportJob]] = {}
    for p in report.problems:
        reason = (p.error.code, p.error.message) if p.error is not None else None
        groups.setdefault((p.status, reason), []).append(p)
    return sorted(groups.values(), key=lambda jobs: -len(jobs))


def _per_hour(report: BatchReport) -> str | None:
    """The batch's videos per hour as its card shows it; None before a job has run and ended."""
    per_hour = report.videos_per_hour
    if per_hour is None or report.active_seconds is None:
        return None
    return f"{per_hour:,.0f}" if per_hour >= 10 else f"{per_hour:.2g}"


def render_main(public: BatchPublic, report: BatchReport, *, last_event: int) -> str:
    """The ``<main>`` of the page for one batch (``templates/batch.html``)."""
    return pages.render(
        "batch.html", public=public, report=report, last_event=last_event,
        finished=public.status == "finished", final_states=_FINAL,
        succeeded=report.counts.get(JobState.SUCCEEDED, 0), per_hour=_per_hour(report),
        problem_groups=_problem_groups(report), examples_per_reason=EXAMPLES_PER_REASON,
        max_job_rows=MAX_JOB_ROWS)


def page(main: str | None, batch_id: str) -> str:
    """The whole page around ``main`` (None: the shell that loads it with the stored key)."""
    return pages.page(main, title=f"batch {batch_id}", heading=f"batch report {batch_id}",
                      script="batch_page.js")
