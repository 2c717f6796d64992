"""Batch routes: submit many jobs at once, follow them, cancel them, read the morning report."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import batches as batch_service
from api import jobs
from api.deps import CurrentUser, RedisDep, SessionDep, SettingsDep
from api.routes.jobs import IdempotencyKey
from api.schemas import BatchCancelled, BatchList, BatchPublic, BatchReport, SafeQuery
from storage import batches
from storage.tables import Batch, User

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BatchId = Annotated[str, Path(description="The batch id: 20 lowercase letters and digits.")]
_NOT_FOUND = "batch not found"


def visible_batch(session: Session, batch_id: str, user: User) -> Batch:
    """The batch, or 404 -- also for another user's batch, so ids cannot be probed."""
    batch = batches.get_batch(session, batch_id, user)
    if batch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, _NOT_FOUND)
    return batch


@router.post("", status_code=status.HTTP_201_CREATED, response_model=BatchPublic,
             openapi_extra=batch_service.OPENAPI_BODY,
             responses={200: {"description": "Idempotent replay: the batch made earlier"},
                        409: {"description": "Idempotency-Key reused with another body"},
                        413: {"description": "Body over max_batch_body_bytes"},
                        415: {"description": "Not JSON, JSONL or a multipart upload"},
                        422: {"description": "A bad line: detail names its line and field"},
                        429: {"description": "Too many queued jobs; see Retry-After"}})
async def create_batch(request: Request, user: CurrentUser, session: SessionDep,
                       redis: RedisDep, settings: SettingsDep, response: Response,
                       idempotency_key: IdempotencyKey = None) -> BatchPublic:
    """JSON ``{"defaults", "jobs", "window", "metadata", "name"}``, or JSONL (one job per line)
    as an ``application/x-ndjson`` body or a multipart upload in the field ``file``, with the
    options in the query string or form fields. Every job is checked as by ``POST /v1/jobs``;
    one bad line refuses the whole batch."""
    submission = await batch_service.read_submission(request)
    # Checking thousands of lines and the database work block; keep them off the event loop.
    return await run_in_threadpool(batch_service.submit, session, redis, settings, user,
                                   submission, idempotency_key=idempotency_key,
                                   response=response)


@router.get("", response_model=BatchList)
def list_batches(
    user: CurrentUser, session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, pattern=SafeQuery)] = None,
    owner: Annotated[str | None, Query(max_length=64, pattern=SafeQuery,
                                       description="a user name (admins only)")] = None,
) -> BatchList:
    owner_id = jobs.owner_filter(session, user, owner, "batches")
    try:
        page, next_cursor = batches.list_batches(session, user, owner_id=owner_id, limit=limit,
                                                 cursor=cursor)
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"cursor: {exc}") from exc
    return BatchList(data=batch_service.details(session, user, page), next_cursor=next_cursor,
                     has_more=next_cursor is not None)


@router.get("/{batch_id}", response_model=BatchPublic)
def get_batch(batch_id: BatchId, user: CurrentUser, session: SessionDep) -> BatchPublic:
    return batch_service.detail(session, user, visible_batch(session, batch_id, user))


@router.post("/{batch_id}/cancel", response_model=BatchCancelled,
             responses={409: {"description": "Every job of the batch already finished"}})
def cancel_batch(batch_id: BatchId, user: CurrentUser, session: SessionDep, redis: RedisDep,
                 settings: SettingsDep) -> BatchCancelled:
    """Queued jobs are cancelled at once; running ones stop after their current step."""
    batch = visible_batch(session, batch_id, user)
    done = batches.cancel_batch(session, batch, user)
    for job in done.cancelled:
        jobs.unindex(redis, settings, job)
    public = batch_service.detail(session, user, batch)
    if not done.cancelled and not done.num_requested and public.status == "finished":
        raise HTTPException(status.HTTP_409_CONFLICT,
                            "every job of the batch already finished; there is nothing to cancel")
    return BatchCancelled(cancelled=len(done.cancelled), cancel_requested=done.num_requested,
                          batch=public)


@router.get("/{batch_id}/report", response_model=BatchReport)
def batch_report(batch_id: BatchId, user: CurrentUser, session: SessionDep) -> BatchReport:
    """Counts per final state with the reason of each failed or expired job, throughput, total
    render seconds and every job's links."""
    return batch_service.report(session, visible_batch(session, batch_id, user))
