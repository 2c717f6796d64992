"""The job page (``GET /dashboard/jobs/{id}``), rendered on the server: the job's parameters, its
timeline from ``job_events`` (created, each attempt with its worker group, rank and outcome,
where an attempt resumed from, its suspensions for interactive jobs, finished), its video and
thumbnail, the image or video it started from (with how it was fitted, and the strength), the
LoRA adapters it applies (by name, with their scales), its error, and a cancel button.

The HTML is ``templates/job.html``, where every piece of user text is escaped (autoescape, see
`api.pages`). The page's scripts, served by kiln (``assets/page.js``, shared with the batch page,
and ``assets/job_page.js``), fetch the outputs with the key and keep the page current from
``GET /v1/events``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from api import pages
from common.families import family_of
from storage.tables import TERMINAL_STATES, InputFile, Job, JobEvent, JobState, LoraAdapter
from storage.webhooks import DeliveryLog, wants

_OUTCOMES = {"requeued", "succeeded", "failed", "dead", "cancelled"}
# Each event kind's line style in the timeline; the others are dim.
_ROW_CLASSES = {"created": "queued", "claimed": "attempt", "requeued": "queued",
                "succeeded": "finished", "failed": "finished", "dead": "finished",
                "cancelled": "finished", "expired": "finished", "resumed": "attempt"}
# The delivery log's outcomes and outbox states, as the chip colours of job states.
_DELIVERY_CHIPS = {"delivered": "succeeded", "retrying": "queued", "pending": "queued",
                   "failed": "failed", "unwanted": "cancelled"}


@dataclass
class _Row:
    """One line of the timeline: ``event``, and for an attempt (a ``claimed`` event) the event
    that ended it (None: none yet) and whether it is the attempt running now."""

    event: JobEvent
    cls: str
    ended: JobEvent | None = None
    running: bool = False


def _timeline(job: Job, events: Sequence[JobEvent]) -> list[_Row]:
    """The timeline's lines: every event, but an attempt's outcome is shown on the attempt's own
    line (its ``requeued`` event gets no line of its own)."""
    ends: dict[int, JobEvent | None] = {}  # attempt -> the event that ended it
    for e in events:
        if e.kind == "claimed":
            ends[e.attempt] = None
        elif e.kind in _OUTCOMES and e.attempt in ends and ends[e.attempt] is None:
            ends[e.attempt] = e
    rows = []
    for e in events:
        if e.kind == "claimed":
            ended = ends[e.attempt]
            running = (ended is None and job.state == JobState.RUNNING
                       and job.attempts == e.attempt)
            rows.append(_Row(e, "attempt", ended, running))
        elif not (e.kind == "requeued" and ends.get(e.attempt) is e):
            rows.append(_Row(e, _ROW_CLASSES.get(e.kind, "dim")))
    return rows


def adapter_names(session: Session, job: Job) -> dict[str, str]:
    """The names of the job's adapters by id (one deleted since has none)."""
    ids = [a["id"] for a in job.adapters or ()]
    if not ids:
        return {}
    rows = session.execute(select(LoraAdapter.id, LoraAdapter.name)
                           .where(LoraAdapter.id.in_(ids)))
    return {adapter_id: name for adapter_id, name in rows}


def render_main(job: Job, events: Sequence[JobEvent], group_names: dict[str, str], *,
                owner: str | None = None, deliveries: DeliveryLog | None = None,
                input_file: InputFile | None = None,
                adapter_names: dict[str, str] | None = None) -> str:
    """The ``<main>`` of the page for ``job`` (``templates/job.html``); ``input_file``: the
    upload it starts from (its ``input_file_id``'s row), shown beside its outputs;
    ``adapter_names``: its adapters' names by id (`adapter_names`)."""
    state = JobState(job.state)
    total = job.progress_total or job.num_inference_steps
    step = total if state == JobState.SUCCEEDED else min(job.progress_step, total)
    terminal = state in TERMINAL_STATES
    return pages.render(
        "job.html", job=job, state=state.value, terminal=terminal, step=step, total=total,
        pct=(100 * step / total) if total else 0.0,
        last_event=events[-1].id if events else 0,
        preview=state == JobState.RUNNING and family_of(job.model).previews,
        rows=_timeline(job, events), group_names=group_names, owner=owner,
        input_file=input_file, adapters=job.adapters or [], adapter_names=adapter_names or {},
        deliveries=deliveries if job.webhook_url else None,
        final_wanted=wants(job.webhook_events, f"job.{state.value}"),
        delivery_chips=_DELIVERY_CHIPS,
        metadata=json.dumps(job.meta, indent=1, sort_keys=True) if job.meta else None)


def page(main: str | None, job_id: str) -> str:
    """The whole page around ``main`` (None: the shell that loads it with the stored key)."""
    return pages.page(main, title=f"job {job_id}", heading=f"job {job_id}", script="job_page.js")
