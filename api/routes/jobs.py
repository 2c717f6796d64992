"""Native job routes: submit, read, list, cancel, download, a running job's preview."""

from __future__ import annotations

import contextlib
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Path, Query, Response, status
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from redis import Redis, RedisError
from sqlalchemy.orm import Session

from api import jobs
from api.bodies import DepthCheckedRoute
from api.deps import CurrentUser, QueueRoomDep, RedisDep, SessionDep, SettingsDep, StoreDep
from api.schemas import JobCreate, JobList, JobPublic, SafeQuery
from common.families import family_of
from common.settings import Settings
from scheduler import queue_index
from storage import adapters, input_files, lifecycle, queries
from storage.outputs import OutputStore, preview_key, preview_step
from storage.tables import InputFile, Job, JobClass, JobState, User

# Job bodies are parsed by FastAPI itself; the route class bounds their nesting first.
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=DepthCheckedRoute)

IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", max_length=255, pattern=r"^[!-~]+$",
           description="Same key and body -> the same job; same key, other body -> 409."),
]
JobId = Annotated[str, Path(description="The job id: 20 lowercase letters and digits.")]
_NOT_FOUND = "job not found"


def visible_job(session: Session, job_id: str, user: User) -> Job:
    """The job, or 404 -- also for another user's job, so ids cannot be probed."""
    job = queries.get_job(session, job_id, user)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, _NOT_FOUND)
    return job


def _owner_name(session: Session, viewer: User, job: Job) -> str | None:
    if not viewer.is_admin:
        return None
    owner = session.get(User, job.owner_id)
    return owner.name if owner else None


def detail(session: Session, redis: Redis, settings: Settings, viewer: User,
           job: Job, position: int | None = None) -> JobPublic:
    """The job as its viewer sees it; ``position``: its queue position, when already known."""
    if job.state == JobState.QUEUED and position is None:
        # The index answers in O(log n); counting rows in the database is the fallback.
        try:
            position = queue_index.position(redis, settings.redis_prefix, job)
        except RedisError:
            position = None
        if position is None:
            position = queries.queue_position(session, job)
    return jobs.job_public(job, queue_position=position,
                              owner=_owner_name(session, viewer, job))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic,
             responses={200: {"description": "Idempotent replay: the job made earlier"},
                        409: {"description": "Idempotency-Key reused with another body"},
                        429: {"description": "Too many queued jobs; see Retry-After"}})
def create_job(body: JobCreate, user: CurrentUser, session: SessionDep, redis: RedisDep,
               settings: SettingsDep, room: QueueRoomDep, response: Response,
               idempotency_key: IdempotencyKey = None) -> JobPublic:
    spec = jobs.spec_from_job_create(body, settings, jobs.now(),
                                     input_files.kinds_of(session, user),
                                     adapters.models_of(session, user))
    digest = jobs.request_hash("job", body.model_dump(mode="json", by_alias=True))
    created, position = jobs.submit(session, redis, settings, user, spec,
                                       request_hash=digest, idempotency_key=idempotency_key,
                                       room=room)
    if not created.created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    return detail(session, redis, settings, user, created.job, position)


@router.get("", response_model=JobList)
def list_jobs(
    user: CurrentUser, session: SessionDep,
    status_: Annotated[list[JobState] | None, Query(alias="status",
                                                    description="repeatable")] = None,
    model: Annotated[str | None, Query(max_length=100, pattern=SafeQuery)] = None,
    job_class: Annotated[JobClass | None, Query(alias="class")] = None,
    batch_id: Annotated[str | None, Query(max_length=20, pattern=SafeQuery)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, pattern=SafeQuery)] = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    owner: Annotated[str | None, Query(max_length=64, pattern=SafeQuery,
                                       description="a user name (admins only)")] = None,
) -> JobList:
    owner_id = jobs.owner_filter(session, user, owner, "jobs")
    try:
        page, next_cursor = queries.list_jobs(
            session, user, states=[s.value for s in status_ or []], model=model,
            job_class=job_class.value if job_class else None, batch_id=batch_id,
            owner_id=owner_id, limit=limit, cursor=cursor,
            newest_first=order == "desc",
        )
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"cursor: {exc}") from exc
    data = [jobs.job_public(j, owner=_owner_name(session, user, j)) for j in page]
    return JobList(data=data, next_cursor=next_cursor, has_more=next_cursor is not None)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, user: CurrentUser, session: SessionDep, redis: RedisDep,
            settings: SettingsDep) -> JobPublic:
    return detail(session, redis, settings, user, visible_job(session, job_id, user))


@router.post("/{job_id}/cancel", response_model=JobPublic,
             responses={409: {"description": "The job already finished"}})
def cancel_job(job_id: JobId, user: CurrentUser, session: SessionDep, redis: RedisDep,
               settings: SettingsDep) -> JobPublic:
    """A queued job is cancelled at once; a running one stops after its current step."""
    result = lifecycle.request_cancel(session, job_id, user)
    if result is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, _NOT_FOUND)
    job, was_queued = result
    if was_queued:
        jobs.unindex(redis, settings, job)
    elif job.state not in (JobState.RUNNING, JobState.CANCELLED):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"the job already {job.state}; there is nothing to cancel")
    return detail(session, redis, settings, user, job)


def serve_output(store: OutputStore, job: Job, which: str) -> Response:
    """The job's video or thumbnail: the file itself, or a redirect to a presigned URL."""
    key = job.output_video_key if which == "video" else job.output_thumbnail_key
    if job.state != JobState.SUCCEEDED:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"the job is {job.state}; its {which} exists only once it succeeded")
    if key is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"this job has no {which}")
    media_type = "video/mp4" if which == "video" else "image/png"
    filename = f"{job.id}.{'mp4' if which == 'video' else 'png'}"
    return _serve_stored(store, key, media_type, filename, which)


def _serve_stored(store: OutputStore, key: str, media_type: str, filename: str,
                  what: str) -> Response:
    """The store's file under ``key``: the file itself, or a redirect to a presigned URL."""
    path = store.local_path(key)
    if path is not None:
        if not path.is_file():
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"the {what} file is missing")
        return FileResponse(path, media_type=media_type, filename=filename)
    url = store.url(key)
    if url is not None:
        return RedirectResponse(url, status_code=status.HTTP_307_TEMPORARY_REDIRECT)
    try:
        stream = store.open(key)
    except FileNotFoundError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"the {what} file is missing") from exc
    return StreamingResponse(stream, media_type=media_type)


@router.get("/{job_id}/video", response_class=Response,
            responses={200: {"content": {"video/mp4": {}}}})
def get_video(job_id: JobId, user: CurrentUser, session: SessionDep,
              store: StoreDep) -> Response:
    return serve_output(store, visible_job(session, job_id, user), "video")


@router.get("/{job_id}/thumbnail", response_class=Response,
            responses={200: {"content": {"image/png": {}}}})
def get_thumbnail(job_id: JobId, user: CurrentUser, session: SessionDep,
                  store: StoreDep) -> Response:
    return serve_output(store, visible_job(session, job_id, user), "thumbnail")


@router.get("/{job_id}/input", response_class=Response,
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {},
                                         "video/mp4": {}, "video/webm": {}}},
                       404: {"description": "The job started from text only, or its input "
                                            "file was deleted"}})
def get_input(job_id: JobId, user: CurrentUser, session: SessionDep,
              store: StoreDep) -> Response:
    """The upload the job starts from (its ``input_file_id``), as it was uploaded: to whoever
    may see the job, its owner's file included for an admin (``GET /v1/files`` shows a user
    only their own)."""
    job = visible_job(session, job_id, user)
    row = session.get(InputFile, job.input_file_id) if job.input_file_id else None
    if row is None:
        reason = ("its input file was deleted" if job.input_fit is not None
                  else "it starts from text only")
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"this job has no input: {reason}")
    return _serve_stored(store, row.storage_key, row.content_type, row.filename or row.id,
                         "input")


@router.get("/{job_id}/preview", response_class=Response,
            responses={200: {"content": {"image/png": {}}},
                       404: {"description": "No preview: none yet, the job is not running, or "
                                            "its model offers none"}})
def get_preview(job_id: JobId, user: CurrentUser, session: SessionDep,
                store: StoreDep) -> Response:
    """The newest preview frame of a running job (the current estimate of its middle frame,
    every few steps, from models that offer one: kiln-tiny). ``Kiln-Preview-Step: k/n``: the
    step it shows."""
    job = visible_job(session, job_id, user)
    if not family_of(job.model).previews:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"the model {job.model} offers no preview")
    if job.state != JobState.RUNNING:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"the job is {job.state}; a preview exists only while it runs")
    try:
        with contextlib.closing(store.open(preview_key(job.id))) as stream:
            data = stream.read()
    except FileNotFoundError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no preview of this job yet") from exc
    headers = {"Cache-Control": "no-store"}
    shows = preview_step(data)
    if shows is not None:
        headers["Kiln-Preview-Step"] = f"{shows[0]}/{shows[1]}"
    return Response(data, media_type="image/png", headers=headers)
