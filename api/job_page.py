"""The job page (``GET /dashboard/jobs/{id}``), rendered on the server: the job's parameters, its
timeline from ``job_events`` (created, each attempt with its worker group, rank and outcome,
where an attempt resumed from, its suspensions for interactive jobs, finished), its video and
thumbnail, its error, and a cancel button.

Every piece of user text goes through `html.escape`. The page's scripts, served by kiln
(``assets/page.js``, shared with the batch page, and ``assets/job_page.js``), fetch the outputs
with the key and keep the page current from ``GET /v1/events``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from api import pages
from api.pages import e as _e
from api.pages import seconds as _seconds
from api.pages import time as _time
from common.families import family_of
from storage.tables import TERMINAL_STATES, Job, JobEvent, JobState
from storage.webhooks import DeliveryLog, wants

_OUTCOMES = {"requeued", "succeeded", "failed", "dead", "cancelled"}


@dataclass
class _Attempt:
    started: JobEvent
    ended: JobEvent | None = None


def _why(detail: dict[str, Any]) -> str:
    reason = detail.get("error") or detail.get("reason")
    return f": {_e(reason)}" if reason else ""


def _step_of(detail: dict[str, Any]) -> str:
    """"20 of 30" (or "20" without a total) from a resumed, preempted or continued event."""
    total = detail.get("total_steps")
    return _e(detail.get("step")) + (f" of {_e(total)}" if total else "")


def _timeline(job: Job, events: Sequence[JobEvent], group_names: dict[str, str]) -> str:
    attempts: dict[int, _Attempt] = {}
    rows: list[str] = []

    def row(at: datetime | None, what: str, cls: str = "") -> None:
        rows.append(f'<li class="{cls}"><span class="when">{_time(at)}</span> {what}</li>')

    for e in events:
        if e.kind == "claimed":
            attempts[e.attempt] = _Attempt(e)
        elif e.kind in _OUTCOMES and e.attempt in attempts and attempts[e.attempt].ended is None:
            attempts[e.attempt].ended = e
    for e in events:
        detail = e.detail or {}
        kind = e.kind
        if kind == "created":
            batch = detail.get("batch_id")
            row(e.at, "created" + (f' in batch <span class="mono">{_e(batch)}</span>'
                                   if batch else ""), "queued")
        elif kind == "claimed":
            a = attempts[e.attempt]
            group = detail.get("worker_group_id")
            name = group_names.get(group or "", group)
            where = f'worker group <span class="mono" title="{_e(group)}">{_e(name)}</span>'
            if detail.get("rank") is not None:
                where += f", rank {_e(detail['rank'])}"
            if a.ended is None:
                outcome = ('<span class="chip running">running</span>'
                           if job.state == JobState.RUNNING and job.attempts == e.attempt
                           else '<span class="dim">no outcome recorded</span>')
            else:
                took = _seconds((a.ended.at - e.at).total_seconds())
                outcome = (f'<span class="chip {_e(a.ended.kind)}">{_e(a.ended.kind)}</span> '
                           f'after {took}{_why(a.ended.detail or {})}')
            row(e.at, f"attempt {e.attempt} on {where} → {outcome}", "attempt")
        elif kind == "requeued":
            if e.attempt in attempts and attempts[e.attempt].ended is e:
                continue  # shown on its attempt's line
            row(e.at, f"back in the queue{_why(detail)}", "queued")
        elif kind in ("succeeded", "failed", "dead", "cancelled", "expired"):
            extra = ""
            if kind == "succeeded" and detail.get("render_seconds") is not None:
                extra = f", rendered in {_seconds(float(detail['render_seconds']))}"
            elif kind == "cancelled" and detail.get("at_step") is not None:
                extra = f" at step {_e(detail['at_step'])}"
            elif kind != "succeeded":
                extra = _why(detail)
            row(e.at, f'finished: <span class="chip {kind}">{kind}</span>{extra}', "finished")
        elif kind == "resumed":
            row(e.at, f"resumed from step {_step_of(detail)}", "attempt")
        elif kind == "preempted":
            by = detail.get("by_job")
            for_job = (f' for interactive job <span class="mono">{_e(by)}</span>'
                       if by else "")
            row(e.at, f"suspended at step {_step_of(detail)}{for_job}", "dim")
        elif kind == "continued":
            row(e.at, f"continued at step {_step_of(detail)}", "dim")
        elif kind == "cancel_requested":
            row(e.at, f"cancel requested by {_e(detail.get('by'))}", "dim")
        elif kind == "purged":
            row(e.at, "video and thumbnail deleted (retention)", "dim")
        else:
            row(e.at, _e(kind), "dim")
    if not rows:
        return '<p class="empty">no events recorded</p>'
    return f'<ol class="timeline">{"".join(rows)}</ol>'


def _resumes(job: Job) -> str:
    """Where the latest attempt resumed from, and how often the job was preempted."""
    notes = []
    if job.resumed_from_step is not None:
        notes.append(f'<span id="resumed">resumed from step {_e(job.resumed_from_step)}</span>')
    if job.preemptions:
        times = "time" if job.preemptions == 1 else "times"
        notes.append(f'<span id="preemptions">preempted {_e(job.preemptions)} {times}</span>')
    return "".join(f" · {n}" for n in notes)


def _parameters(job: Job, owner: str | None) -> str:
    size = f"{job.width}×{job.height}, {job.num_frames} frames at {job.fps} fps"
    items: list[tuple[str, str]] = [
        ("prompt", f'<div class="text">{_e(job.prompt)}</div>'),
        ("negative prompt", f'<div class="text">{_e(job.negative_prompt)}</div>'
         if job.negative_prompt else '<span class="dim">—</span>'),
        ("model", f'<span class="mono">{_e(job.model)}</span>'),
        ("size", _e(size)),
        ("steps", _e(job.num_inference_steps)),
        ("guidance scale", _e(job.guidance_scale)),
        ("seed", f'<span class="mono">{_e(job.seed)}</span>'),
        ("class · priority", f"{_e(job.class_)} · {_e(job.priority)}"),
        ("attempts", f"{_e(job.attempts)} of {_e(job.max_attempts)}{_resumes(job)}"),
        ("submitted", _time(job.created_at)),
        ("started", _time(job.started_at)),
        ("finished", _time(job.finished_at)),
    ]
    if owner is not None:
        items.insert(0, ("owner", _e(owner)))
    if job.render_seconds is not None:
        items.append(("render time", _seconds(job.render_seconds)))
    if job.not_before or job.deadline:
        items.append(("window", f"{_time(job.not_before)} → {_time(job.deadline)}"))
    if job.batch_id:
        line = f", line {_e(job.batch_index)}" if job.batch_index else ""
        items.append(("batch", f'<span class="mono">{_e(job.batch_id)}</span>{line}'))
    if job.webhook_url:
        items.append(("webhook", f'<span class="mono">{_e(job.webhook_url)}</span>'))
    if job.meta:
        items.append(("metadata",
                      f'<pre class="mono">{_e(json.dumps(job.meta, indent=1, sort_keys=True))}'
                      "</pre>"))
    cells = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in items)
    return f'<table class="params">{cells}</table>'


def _media(job: Job) -> str:
    if job.state == JobState.RUNNING and family_of(job.model).previews:
        return _preview(job)
    if job.state != JobState.SUCCEEDED:
        return ""
    video = f"/v1/jobs/{job.id}/video"
    thumb = f"/v1/jobs/{job.id}/thumbnail"
    parts = []
    if job.output_video_key:
        poster = f' data-poster="{thumb}"' if job.output_thumbnail_key else ""
        parts.append(f'<video controls preload="metadata" data-src="{video}"{poster} '
                     f'width="{job.width}" height="{job.height}"></video>'
                     f'<div><a href="{video}" data-download="{job.id}.mp4">download MP4</a></div>')
    if job.output_thumbnail_key:
        parts.append(f'<figure><img class="thumb large" data-src="{thumb}" alt="thumbnail" '
                     f'width="{job.width}" height="{job.height}">'
                     "<figcaption>thumbnail</figcaption></figure>")
    if not parts:
        return '<p class="empty">the outputs have been deleted</p>'
    return f'<section><h2>Video</h2><div class="media">{"".join(parts)}</div></section>'


def _preview(job: Job) -> str:
    """A running job's newest preview frame; hidden until the page's script has fetched one
    and set the step it shows. (No width and height: the stylesheet sizes it, at its aspect.)"""
    total = job.progress_total or job.num_inference_steps
    return (f'<section hidden><h2>Preview</h2><div class="media"><figure>'
            f'<img class="preview" data-src="/v1/jobs/{_e(job.id)}/preview" alt="preview">'
            '<figcaption>current estimate, step '
            f'{_e(job.progress_step)} of {_e(total)}</figcaption></figure></div></section>')


# The delivery log's outcomes and outbox states, as the chip colours of job states.
_DELIVERY_CHIPS = {"delivered": "succeeded", "retrying": "queued", "pending": "queued",
                   "failed": "failed", "unwanted": "cancelled"}


def _final_delivery(job: Job, log: DeliveryLog) -> str:
    """Where the job's final event stands, from its outbox record."""
    if JobState(job.state) not in TERMINAL_STATES:
        return "the final event is sent when the job ends"
    kind = f"job.{job.state}"
    row = log.final
    if row is None:
        return (f"{kind} is not asked for: nothing is sent" if not wants(job.webhook_events, kind)
                else f"{kind} is owed; its first attempt is on its way")
    chip = f'<span class="chip {_DELIVERY_CHIPS.get(row.state, "")}">{_e(row.state)}</span>'
    if row.state == "delivered":
        return f"{kind} {chip} at {_time(row.finished_at)} (attempt {row.attempts})"
    if row.state == "failed":
        return f"{kind} {chip}: gave up after {row.attempts} attempts ({_e(row.last_error)})"
    if row.state == "unwanted":
        return f"{kind} {chip}: not asked for, nothing was sent"
    return (f"{kind} {chip} after {row.attempts} attempts; the next not before "
            f"{_time(row.next_attempt_at)}")


def _deliveries(job: Job, log: DeliveryLog | None) -> str:
    """The "Webhook deliveries" section: the final event's state and every attempt logged."""
    if not job.webhook_url or log is None:
        return ""
    asked = ", ".join(job.webhook_events) if job.webhook_events is not None else \
        "the final events"
    rows = []
    for a in log.attempts:
        result = f"HTTP {_e(a.status)}" if a.status is not None else ""
        if a.error and a.outcome != "delivered":
            result += f'{" · " if result else ""}<span class="dim">{_e(a.error)}</span>'
        rows.append(f'<tr><td class="nowrap">{_time(a.at)}</td><td class="mono">{_e(a.event)}'
                    f'</td><td>{_e(a.attempt)}</td><td>{result}</td><td><span class="chip '
                    f'{_DELIVERY_CHIPS.get(a.outcome, "")}">{_e(a.outcome)}</span></td></tr>')
    table = '<p class="empty">no attempts yet</p>'
    if rows:
        table = ("<div><table><tr><th>when</th><th>event</th><th>attempt</th><th>answer</th>"
                 f'<th></th></tr>{"".join(rows)}</table></div>')
        if log.num_attempts > len(rows):
            table += (f'<p class="empty">the newest {len(rows)} of {log.num_attempts} '
                      "attempts</p>")
    return (f'<section id="deliveries"><h2>Webhook deliveries<span class="aside mono">'
            f'{_e(job.webhook_url)}</span></h2><p class="empty">asked for: {_e(asked)} · '
            f"{_final_delivery(job, log)}</p>{table}</section>")


def render_main(job: Job, events: Sequence[JobEvent], group_names: dict[str, str], *,
                owner: str | None = None, deliveries: DeliveryLog | None = None) -> str:
    """The ``<main>`` of the page for ``job``."""
    state = job.state
    total = job.progress_total or job.num_inference_steps
    step = total if state == JobState.SUCCEEDED else min(job.progress_step, total)
    pct = (100 * step / total) if total else 0.0
    last_event = events[-1].id if events else 0
    terminal = JobState(state) in TERMINAL_STATES
    cancel = "" if terminal or job.cancel_requested else \
        '<button id="cancel" type="button" class="danger">Cancel job</button>'
    pending = ('<span class="dim">cancel requested; the job stops after its current step'
               '</span>') if job.cancel_requested and not terminal else ""
    error = ""
    if job.error and state != JobState.SUCCEEDED:
        label = "error" if terminal else "last attempt's error"
        code = f' <span class="mono dim">({_e(job.error_code)})</span>' if job.error_code else ""
        error = (f'<section><h2>{label}{code}</h2><pre class="error" id="job-error">'
                 f"{_e(job.error)}</pre></section>")
    return f"""<main class="narrow" data-job="{_e(job.id)}" data-state="{_e(state)}"
    data-last-event="{last_event}" data-terminal="{'true' if terminal else 'false'}">
  <section class="head">
    <div><span class="chip {_e(state)}" id="state">{_e(state)}</span>
      <span class="mono" id="job-id">{_e(job.id)}</span></div>
    <div class="progress"><div class="bar wide {_e(state)}"><div id="bar" style="width:{pct:.0f}%">
      </div></div><span class="dim" id="steps">{step}/{total} steps</span></div>
    <div class="actions">{cancel}{pending}<span id="live" class="dim"></span></div>
  </section>
  {error}
  {_media(job)}
  <section><h2>Timeline</h2>{_timeline(job, events, group_names)}</section>
  {_deliveries(job, deliveries)}
  <section><h2>Parameters</h2>{_parameters(job, owner)}</section>
</main>"""


def page(main: str | None, job_id: str) -> str:
    """The whole page around ``main`` (None: the shell that loads it with the stored key)."""
    return pages.page(main, title=f"job {job_id}", heading=f"job {job_id}", script="job_page.js")
