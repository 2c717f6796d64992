"""The batch page (``GET /dashboard/batches/{id}``), rendered on the server: where the batch
stands (status, window, progress, counts, ETA) and its morning report (the jobs that ended and
how, each problem's reason, throughput, render time, every job linking to its page).

The figures are `api.batches`' own (`BatchPublic`, `BatchReport`), so the page and
``GET /v1/batches/{id}/report`` never disagree. Every piece of user text goes through
`html.escape`. The scripts (``assets/kiln.js``, ``page.js`` and ``batch_page.js``) load it with the
stored key and reload it when one of its jobs changes.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from api import batches as batch_views
from api import pages
from api.pages import e as _e
from api.pages import seconds as _seconds
from api.pages import time as _time
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


def _chip(state: str) -> str:
    return f'<span class="chip {_e(state)}">{_e(state)}</span>'


def _job_link(job_id: str) -> str:
    return f'<a class="mono" href="/dashboard/jobs/{_e(job_id)}">{_e(job_id)}</a>'


def _error(row: BatchReportJob) -> str:
    if row.error is None:
        return ""
    return f'<span class="mono dim">{_e(row.error.code)}</span> {_e(row.error.message)}'


def _card(value: str, label: str, sub: str = "", cls: str = "") -> str:
    sub_html = f'<div class="s">{sub}</div>' if sub else ""
    return (f'<div class="card {cls}"><div class="n">{value}</div>'
            f'<div class="l">{_e(label)}</div>{sub_html}</div>')


def _report_cards(report: BatchReport) -> str:
    counts = report.counts
    cards = [_card(str(counts.get(state, 0)), state, cls=state) for state in _FINAL]
    succeeded = counts.get(JobState.SUCCEEDED, 0)
    if report.videos_per_hour is not None and report.active_seconds is not None:
        per_hour = report.videos_per_hour
        rate = _card(f"{per_hour:,.0f}" if per_hour >= 10 else f"{per_hour:.2g}",
                     "videos per hour",
                     f"over {_seconds(report.active_seconds)} of running")
    else:
        rate = _card("—", "videos per hour", "once a job has run and ended")
    mean = (_seconds(report.total_render_seconds / succeeded) if succeeded else "—")
    cards += [rate,
              _card(_seconds(report.total_render_seconds), "render time", "all videos"),
              _card(mean, "mean render time", "per video")]
    return f'<div class="cards report">{"".join(cards)}</div>'


# Jobs named per reason: a reason shared by a thousand expired jobs is one row, not a thousand.
EXAMPLES_PER_REASON = 5


def _problems(report: BatchReport) -> str:
    """The problems grouped by state and reason, most common first, a few jobs named each."""
    if not report.problems:
        return ""
    groups: dict[tuple[str, str], list[BatchReportJob]] = {}
    for p in report.problems:
        groups.setdefault((p.status, _error(p) or _e("no reason recorded")), []).append(p)
    rows = []
    for (state, reason), jobs in sorted(groups.items(), key=lambda g: -len(g[1])):
        named = ", ".join(f"{_job_link(j.id)}{f' (line {_e(j.line)})' if j.line else ''}"
                          for j in jobs[:EXAMPLES_PER_REASON])
        more = (f' <span class="dim">and {len(jobs) - EXAMPLES_PER_REASON} more</span>'
                if len(jobs) > EXAMPLES_PER_REASON else "")
        rows.append(f'<tr><td class="n">{len(jobs)}</td><td>{_chip(state)}</td>'
                    f'<td class="text">{reason}</td><td>{named}{more}</td></tr>')
    return (f'<section><h2>Failed, expired and dead<span class="aside">{len(report.problems)}'
            '</span></h2><div><table class="problems"><tr><th>jobs</th><th>state</th>'
            f'<th>reason</th><th>which</th></tr>{"".join(rows)}</table></div></section>')


def _jobs_table(report: BatchReport) -> str:
    rows = []
    for j in report.jobs[:MAX_JOB_ROWS]:
        took = _seconds(j.render_seconds) if j.render_seconds is not None else ""
        rows.append(f"<tr><td class=\"dim\">{_e(j.line)}</td><td>{_job_link(j.id)}</td>"
                    f"<td>{_chip(j.status)}</td><td class=\"prompt\" title=\"{_e(j.prompt)}\">"
                    f"{_e(j.prompt)}</td><td class=\"nowrap\">{took}</td>"
                    f"<td>{_error(j)}</td></tr>")
    more = ""
    if len(report.jobs) > MAX_JOB_ROWS:
        more = (f'<p class="empty">the first {MAX_JOB_ROWS} of {len(report.jobs)} jobs; every '
                f'one is in <span class="mono">/v1/batches/{_e(report.id)}/report</span></p>')
    return (f'<section><h2>Jobs<span class="aside">{len(report.jobs)}</span></h2><div><table>'
            "<tr><th>line</th><th>job</th><th>state</th><th>prompt</th><th>render time</th>"
            f'<th>error</th></tr>{"".join(rows)}</table></div>{more}</section>')


def _summary(public: BatchPublic) -> str:
    items: list[tuple[str, str]] = [
        ("name", _e(public.name) if public.name else '<span class="dim">—</span>'),
        ("id", f'<span class="mono">{_e(public.id)}</span>'),
    ]
    if public.owner is not None:
        items.append(("owner", _e(public.owner)))
    counts = " ".join(f'<span class="chip {_e(state)}">{_e(state)} {n}</span>'
                      for state, n in public.counts.items() if n)
    eta = '<span class="dim">—</span>'
    if public.eta is not None and public.eta_seconds is not None:
        eta = f"{_time(public.eta)} (in {_seconds(public.eta_seconds)})"
    items += [
        ("window", f"{_time(public.not_before)} → {_time(public.deadline)}"),
        ("jobs by state", f'<div class="counts">{counts}</div>'),
        ("ETA", eta),
        ("submitted", _time(public.created_at)),
        ("started", _time(public.started_at)),
        ("finished", _time(public.finished_at)),
    ]
    cells = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in items)
    return f'<table class="params">{cells}</table>'


def render_main(public: BatchPublic, report: BatchReport, *, last_event: int) -> str:
    """The ``<main>`` of the page for one batch."""
    progress = public.progress
    finished = public.status == "finished"
    return f"""<main class="narrow" data-batch="{_e(public.id)}" data-state="{_e(public.status)}"
    data-last-event="{last_event}" data-terminal="{'true' if finished else 'false'}">
  <section class="head">
    <div>{_chip(public.status)} <strong id="batch-name">{_e(public.name or "unnamed batch")}
      </strong> <span class="mono dim">{_e(public.id)}</span></div>
    <div class="progress"><div class="bar wide {_e(public.status)}"><div id="bar"
      style="width:{100 * progress.fraction:.0f}%"></div></div><span class="dim" id="done">
      {progress.finished}/{progress.total} jobs ended ({100 * progress.step_fraction:.0f}% of
      the steps)</span></div>
    <div class="actions"><span id="live" class="dim"></span></div>
  </section>
  <section><h2>Batch</h2>{_summary(public)}</section>
  <section><h2>Morning report</h2>{_report_cards(report)}</section>
  {_problems(report)}
  {_jobs_table(report)}
</main>"""


def page(main: str | None, batch_id: str) -> str:
    """The whole page around ``main`` (None: the shell that loads it with the stored key)."""
    return pages.page(main, title=f"batch {batch_id}", heading=f"batch report {batch_id}",
                      script="batch_page.js")
