"""Batch submissions: reading them (JSON, a JSONL upload or an NDJSON body), checking every job
with `POST /v1/jobs`'s own schema and limits, storing and dispatching them, and rendering a
batch's progress and morning report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, cast

from fastapi import HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from redis import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from api import bodies, jobs
from api.schemas import (
    BatchCreate,
    BatchProgress,
    BatchPublic,
    BatchReport,
    JobCreate,
    metadata_bytes,
)
from common import netguard
from common.settings import Settings
from storage import adapters, batches, input_files
from storage.submission import JobSpec
from storage.tables import Batch, JobClass, User

JSONL_TYPES = frozenset({"application/x-ndjson", "application/jsonl", "application/x-jsonlines",
                         "application/jsonlines"})
# Options a JSONL submission takes beside its lines (query string, or form fields with a file);
# webhook_events as a comma-separated list.
_JSONL_OPTIONS = ("name", "defaults", "metadata", "not_before", "deadline", "webhook_url",
                  "webhook_events")
# A bad batch reports this many bad lines at most: enough to fix a file, bounded for a huge one.
MAX_REPORTED_LINES = 20
_WINDOW_FIELDS = ("not_before", "deadline")

OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": BatchCreate.model_json_schema()},
            "application/x-ndjson": {"schema": {
                "type": "string", "description": "one JobCreate object per line; options "
                f"({', '.join(_JSONL_OPTIONS)}; defaults and metadata as JSON, webhook_events "
                "comma-separated) in the query"}},
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["file"],
                "properties": {"file": {"type": "string", "format": "binary"},
                               **{name: {"type": "string"} for name in _JSONL_OPTIONS}}}},
        },
    }
}


@dataclass(frozen=True, slots=True)
class Submission:
    body: BatchCreate
    lines: list[int]  # per job: its 1-based line in the JSONL (its position in a JSON list)


def _invalid(errors: list[dict[str, Any]]) -> RequestValidationError:
    return RequestValidationError(errors)


def _problem(field: str, message: str, kind: str = "value_error") -> dict[str, Any]:
    return {"loc": ("body", field), "msg": message, "type": kind}


async def read_submission(request: Request) -> Submission:
    """The request as a `BatchCreate` plus each job's line number; 415 for another body type.

    Only reading the body happens on the event loop (the size limit cuts it off while it
    streams); parsing and validating it run in the thread pool: a body near the 16 MiB limit
    takes over a second to parse (a million short lines: 1.4 s) and would stall every other
    request meanwhile."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        return await run_in_threadpool(_from_json, await request.body())
    if content_type in JSONL_TYPES:
        options: dict[str, str] = dict(request.query_params)
        return await run_in_threadpool(_from_jsonl, await request.body(), options,
                                       _max_jobs(request))
    if content_type == "multipart/form-data":
        return await _from_upload(request)
    raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                        "send application/json, a JSONL body (application/x-ndjson) or a "
                        "multipart/form-data upload with the JSONL in the field 'file'")


async def _from_upload(request: Request) -> Submission:
    try:
        form = await request.form(max_files=1, max_fields=len(_JSONL_OPTIONS) + 1)
    except ClientDisconnect:  # not the body's fault: api.errors answers it
        raise
    except Exception as exc:  # the multipart parser's own errors: malformed input
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed form body: {exc}") from exc
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise _invalid([_problem("file", "upload the JSONL file in the form field 'file'",
                                     "missing")])
        raw = await upload.read()
        options = {}
        for key, value in form.multi_items():
            if key == "file":
                continue
            if isinstance(value, UploadFile):
                raise _invalid([_problem(key, "only the field 'file' may be a file")])
            options[key] = value
    finally:
        await form.close()  # uploaded parts are temporary files
    return await run_in_threadpool(_from_jsonl, raw, options, _max_jobs(request))


def _max_jobs(request: Request) -> int:
    settings: Settings = request.app.state.settings
    return settings.max_queued_jobs_per_user


def _from_json(raw: bytes) -> Submission:
    bodies.check_depth(raw)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _invalid([_problem("body", "body is not valid JSON", "json_invalid")]) from exc
    if not isinstance(data, dict):
        raise _invalid([_problem("body", "must be a JSON object", "model_type")])
    found = data.get("jobs")
    lines = list(range(1, len(found) + 1)) if isinstance(found, list) else []
    return Submission(_validated(data), lines)


def _from_jsonl(raw: bytes, options: dict[str, str], max_jobs: int) -> Submission:
    unknown = sorted(set(options) - set(_JSONL_OPTIONS))
    if unknown:
        raise _invalid([_problem(name, "unknown field", "extra_forbidden") for name in unknown])
    data: dict[str, Any] = {}
    problems = []
    for name in ("defaults", "metadata"):
        if name in options:
            try:
                data[name] = bodies.loads(options[name])
            except ValueError:
                problems.append(_problem(name, "must be a JSON object"))
    for name in ("name", "webhook_url"):
        if name in options:
            data[name] = options[name]
    if "webhook_events" in options:
        data["webhook_events"] = [e.strip() for e in options["webhook_events"].split(",")
                                  if e.strip()]
    window = {name: options[name] for name in _WINDOW_FIELDS if options.get(name)}
    if window:
        data["window"] = window
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is not part of line 1
    except UnicodeDecodeError as exc:
        raise _invalid([_problem("file", "is not UTF-8 text", "unicode")]) from exc
    # Only "\n" ends a line: JSON strings may hold U+2028 and friends, which splitlines() cuts.
    all_lines = text.split("\n")
    # Too many jobs is refused before any line is parsed: a million short lines take seconds.
    if len(all_lines) > max_jobs:
        num_jobs = sum(1 for line in all_lines if line.strip())
        if num_jobs > max_jobs:
            raise _invalid([_too_many_jobs(num_jobs, max_jobs)])
    specs, lines = [], []
    for number, line in enumerate(all_lines, start=1):
        if not line.strip():
            continue
        bodies.check_depth(line)
        try:
            specs.append(json.loads(line))
        except ValueError as exc:
            problems.append({"loc": ("body", f"line {number}"), "line": number,
                             "msg": f"is not valid JSON ({exc})", "type": "value_error"})
            if len(problems) >= MAX_REPORTED_LINES:
                break
            continue
        lines.append(number)
    if problems:
        raise _invalid(problems)
    data["jobs"] = specs
    return Submission(_validated(data), lines)


def _too_many_jobs(num_jobs: int, limit: int) -> dict[str, Any]:
    return _problem("jobs", f"at most {limit} jobs in one batch (the per-user queued limit), "
                            f"got {num_jobs}", "too_long")


def _validated(data: dict[str, Any]) -> BatchCreate:
    try:
        return BatchCreate.model_validate(data)
    except ValidationError as exc:
        raise _invalid([{**e, "loc": ("body", *e["loc"])}
                        for e in exc.errors(include_url=False)]) from exc


def specs_from_submission(sub: Submission, s: Settings, now: datetime,
                          kind_of: jobs.InputKinds = jobs.no_inputs,
                          adapter_model: jobs.AdapterModels = jobs.no_adapters
                          ) -> list[JobSpec]:
    """Every job of the batch as a checked `JobSpec`: its line laid over the defaults, class
    ``batch``, the window's times, validated by `JobCreate` and `jobs.spec_from_job_create`
    exactly as `POST /v1/jobs` would. Any bad line fails the whole batch with a 422 naming each
    bad line (up to `MAX_REPORTED_LINES`) and field. ``kind_of`` looks up the submitter's
    uploads, for lines (or defaults) with an ``input_file_id``; ``adapter_model`` the adapters
    they may use, for lines (or defaults) with ``adapters``."""
    body = sub.body
    if not body.jobs:
        raise _invalid([_problem("jobs", "a batch needs at least one job", "too_short")])
    if len(body.jobs) > s.max_queued_jobs_per_user:
        raise _invalid([_too_many_jobs(len(body.jobs), s.max_queued_jobs_per_user)])
    if metadata_bytes(body.metadata) > s.max_metadata_bytes:
        raise _invalid([_problem("metadata", f"at most {s.max_metadata_bytes} bytes as JSON")])
    # Literal addresses only, as for a job's; names are resolved and checked when it is sent.
    if body.webhook_url is not None:
        reason = netguard.submit_refusal(str(body.webhook_url),
                                         private_allowed=netguard.private_allowed(s))
        if reason is not None:
            raise _invalid([_problem("webhook_url", reason)])
    window = ({name: getattr(body.window, name) for name in _WINDOW_FIELDS
               if getattr(body.window, name) is not None} if body.window else {})
    # Defaults and window once, as the part of a job they are; so their mistakes are named once
    # instead of on every line.
    probe = {**body.defaults, "prompt": body.defaults.get("prompt") or "probe", **window}
    errors = (_batch_rules(body.defaults, body.defaults, window)
              or _job_errors(probe, s, now, kind_of, adapter_model))
    if errors:
        raise _invalid([
            {**e, "loc": ("body", f"{'window' if field in window else 'defaults'}.{field}")}
            for field, e in errors])
    specs: list[JobSpec] = []
    problems: list[dict[str, Any]] = []
    bad_lines = 0
    for line, item in zip(sub.lines, body.jobs, strict=True):
        if not isinstance(item, dict):
            errors = [("body", {"msg": "must be a JSON object", "type": "model_type"})]
        else:
            merged = {**body.defaults, **item}
            errors = _batch_rules(item, merged, window)
            if not errors:
                merged.update(window, **{"class": JobClass.BATCH.value})
                spec_or_errors = _job_spec(merged, s, now, kind_of, adapter_model)
                if isinstance(spec_or_errors, JobSpec):
                    specs.append(replace(spec_or_errors, batch_index=line))
                    continue
                errors = spec_or_errors
        problems += [{**e, "line": line, "loc": (
            "body", f"line {line}" if field == "body" else f"line {line}: {field}")}
            for field, e in errors]
        bad_lines += 1
        if bad_lines >= MAX_REPORTED_LINES:
            problems.append(_problem("jobs", f"stopped checking after {bad_lines} bad lines"))
            break
    if problems:
        raise _invalid(problems)
    return specs


def _batch_rules(item: dict[str, Any], merged: dict[str, Any],
                 window: dict[str, datetime]) -> list[tuple[str, dict[str, Any]]]:
    errors = []
    if merged.get("class", JobClass.BATCH.value) != JobClass.BATCH.value:
        errors.append(("class", {"msg": "every job of a batch has class 'batch'",
                                 "type": "value_error"}))
    for name in window:
        if name in item:
            errors.append((name, {"msg": "the batch window sets it for every job",
                                  "type": "value_error"}))
    return errors


def _job_spec(data: dict[str, Any], s: Settings, now: datetime, kind_of: jobs.InputKinds,
              adapter_model: jobs.AdapterModels
              ) -> JobSpec | list[tuple[str, dict[str, Any]]]:
    """The spec `POST /v1/jobs` would make of ``data``, or its errors as (field, error)."""
    try:
        return jobs.spec_from_job_create(JobCreate.model_validate(data), s, now, kind_of,
                                         adapter_model)
    except ValidationError as exc:
        return [(".".join(str(p) for p in e["loc"]) or "body", cast("dict[str, Any]", e))
                for e in exc.errors(include_url=False)]  # an ErrorDetails is a dict
    except RequestValidationError as exc:
        return [(".".join(str(p) for p in e["loc"][1:]) or "body", e) for e in exc.errors()]


def _job_errors(data: dict[str, Any], s: Settings, now: datetime, kind_of: jobs.InputKinds,
                adapter_model: jobs.AdapterModels) -> list[tuple[str, dict[str, Any]]]:
    result = _job_spec(data, s, now, kind_of, adapter_model)
    return [] if isinstance(result, JobSpec) else result


def submit(session: Session, redis: Redis, s: Settings, user: User, sub: Submission, *,
           idempotency_key: str | None, response: Response) -> BatchPublic:
    """Checks every job, stores the batch and its jobs in one transaction, then dispatches them
    to Redis; an idempotent replay answers 200 with the batch made earlier."""
    now = jobs.now()
    specs = specs_from_submission(sub, s, now, input_files.kinds_of(session, user),
                                  adapters.models_of(session, user))
    digest = jobs.request_hash("batch", sub.body.model_dump(mode="json"))
    window = sub.body.window
    with jobs.creation_errors_as_http(s):
        created = batches.create_batch(
            session, user, specs, name=sub.body.name, metadata=dict(sub.body.metadata),
            not_before=window.not_before if window else None,
            deadline=window.deadline if window else None,
            webhook_url=str(sub.body.webhook_url) if sub.body.webhook_url else None,
            webhook_events=(sorted(set(sub.body.webhook_events))
                            if sub.body.webhook_events is not None else None),
            request_hash=digest,
            idempotency_key=idempotency_key, max_attempts=s.max_attempts,
            max_queued=s.max_queued_jobs_per_user, now=now,
        )
    jobs.dispatch(redis, s, created.jobs)
    if not created.created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    return detail(session, user, created.batch)


def owner_name(session: Session, viewer: User, owner_id: int) -> str | None:
    if not viewer.is_admin:
        return None
    owner = session.get(User, owner_id)
    return owner.name if owner else None


def detail(session: Session, viewer: User, batch: Batch) -> BatchPublic:
    summary = batches.summaries(session, [batch.id])[batch.id]
    return batch_public(batch, summary, jobs.now(),
                        owner=owner_name(session, viewer, batch.owner_id))


def details(session: Session, viewer: User, rows: Sequence[Batch]) -> list[BatchPublic]:
    found = batches.summaries(session, [b.id for b in rows])
    now = jobs.now()
    return [batch_public(b, found[b.id], now, owner=owner_name(session, viewer, b.owner_id))
            for b in rows]


def batch_public(batch: Batch, summary: batches.Summary, now: datetime, *,
                 owner: str | None = None) -> BatchPublic:
    total = summary.total
    if not summary.num_left:
        state = "finished"
    elif summary.started_at is None:
        state = "queued"
    else:
        state = "running"
    eta_seconds = summary.eta_seconds(now)
    return BatchPublic(
        id=batch.id, owner=owner, name=batch.name, metadata=batch.meta,
        not_before=batch.not_before, deadline=batch.deadline, status=state,
        counts=summary.counts,
        progress=BatchProgress(
            finished=summary.num_finished, total=total,
            fraction=round(summary.num_finished / total, 4) if total else 0.0,
            step_fraction=round(summary.step_fraction, 4)),
        eta=now + timedelta(seconds=eta_seconds) if eta_seconds is not None else None,
        eta_seconds=round(eta_seconds, 1) if eta_seconds is not None else None,
        created_at=batch.created_at, started_at=summary.started_at,
        finished_at=summary.finished_at, jobs_url=f"/v1/jobs?batch_id={batch.id}",
        webhook_url=batch.webhook_url, webhook_events=batch.webhook_events,
    )


def report(session: Session, batch: Batch) -> BatchReport:
    """The batch's morning report as `storage.batches.report` builds it, as the API shows it."""
    return BatchReport.model_validate(batches.report(session, batch), from_attributes=True)
