"""OpenAI-compatible video routes, so the official SDK's ``client.videos`` works against kiln.

Statuses map queued -> queued, running -> in_progress, succeeded -> completed, and every other
end (failed, cancelled, dead, expired) -> failed with ``error.code`` saying which. A job made here
is an ordinary kiln job: the native routes see it too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api import bodies, jobs
from api.deps import CurrentUser, RedisDep, SessionDep, SettingsDep, StoreDep
from api.routes.jobs import IdempotencyKey, JobId, serve_output, visible_job
from api.schemas import VideoCreate, VideoDeleted, VideoList, VideoPublic
from storage import lifecycle, pagination, queries

router = APIRouter(prefix="/v1/videos", tags=["openai-compatible"])

_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": VideoCreate.model_json_schema()},
            "application/json": {"schema": VideoCreate.model_json_schema()},
        },
    }
}


async def _read_create_body(request: Request) -> dict[str, Any]:
    """The SDK sends multipart/form-data; plain clients may send JSON or a urlencoded form."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        try:
            data = bodies.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestValidationError(
                [{"loc": ("body",), "msg": "body is not valid JSON", "type": "json_invalid"}]
            ) from exc
        if not isinstance(data, dict):
            raise RequestValidationError(
                [{"loc": ("body",), "msg": "must be a JSON object", "type": "model_type"}])
        return data
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=1, max_fields=32)
        except Exception as exc:  # the multipart parser's own errors: malformed input
            raise HTTPException(status.HTTP_400_BAD_REQUEST,
                                f"malformed form body: {exc}") from exc
        try:
            items = list(form.multi_items())
        finally:
            await form.close()  # uploaded parts are temporary files
        data: dict[str, Any] = {}
        for key, value in items:
            if isinstance(value, UploadFile) or key == "input_reference":
                raise RequestValidationError([{
                    "loc": ("body", key), "type": "unsupported",
                    "msg": "reference images and file uploads are not supported",
                }])
            if key in data:
                raise RequestValidationError(
                    [{"loc": ("body", key), "msg": "given more than once", "type": "duplicate"}])
            data[key] = value
        return data
    raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                        "send multipart/form-data or application/json")


@router.post("", response_model=VideoPublic, openapi_extra=_CREATE_BODY,
             responses={409: {"description": "Idempotency-Key reused with another body"},
                        429: {"description": "Too many queued jobs; see Retry-After"}})
async def create_video(request: Request, user: CurrentUser, session: SessionDep,
                       redis: RedisDep, settings: SettingsDep, response: Response,
                       idempotency_key: IdempotencyKey = None) -> VideoPublic:
    raw = await _read_create_body(request)
    try:
        body = VideoCreate.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from exc
    spec = jobs.spec_from_video_create(body, settings, jobs.now())
    digest = jobs.request_hash("video", body.model_dump(mode="json"))

    def store() -> VideoPublic:
        created, _ = jobs.submit(session, redis, settings, user, spec,
                                    request_hash=digest, idempotency_key=idempotency_key,
                                    room=request.app.state.queue_room)
        if not created.created:
            response.headers["Idempotent-Replayed"] = "true"
        return jobs.video_public(created.job)

    # The database and Redis clients block; keep them off the event loop.
    return await run_in_threadpool(store)


@router.get("", response_model=VideoList)
def list_videos(
    user: CurrentUser, session: SessionDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> VideoList:
    cursor = None
    if after is not None:
        anchor = queries.get_job(session, after, user)
        if anchor is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, "after: no such video")
        cursor = pagination.encode_cursor(anchor)
    page, next_cursor = queries.list_jobs(session, user, limit=limit, cursor=cursor,
                                          newest_first=order == "desc")
    data = [jobs.video_public(j) for j in page]
    return VideoList(data=data, first_id=data[0].id if data else None,
                     last_id=data[-1].id if data else None, has_more=next_cursor is not None)


@router.get("/{video_id}", response_model=VideoPublic)
def retrieve_video(video_id: JobId, user: CurrentUser, session: SessionDep) -> VideoPublic:
    return jobs.video_public(visible_job(session, video_id, user))


@router.delete("/{video_id}", response_model=VideoDeleted,
               responses={409: {"description": "The video is still rendering"}})
def delete_video(video_id: JobId, user: CurrentUser, session: SessionDep, redis: RedisDep,
                 settings: SettingsDep, store: StoreDep) -> VideoDeleted:
    """Deletes a finished video and its files; a queued one is cancelled first."""
    try:
        result = lifecycle.delete_job(session, video_id, user)
    except lifecycle.JobBusy as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    if result is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "job not found")
    job, was_queued = result
    if was_queued:
        jobs.unindex(redis, settings, job)
    for key in (job.output_video_key, job.output_thumbnail_key):
        if key is not None:
            store.delete(key)
    return VideoDeleted(id=job.id)


@router.get("/{video_id}/content", response_class=Response,
            responses={200: {"content": {"video/mp4": {}, "image/png": {}}}})
def download_content(
    video_id: JobId, user: CurrentUser, session: SessionDep, store: StoreDep,
    variant: Annotated[Literal["video", "thumbnail"], Query()] = "video",
) -> Response:
    return serve_output(store, visible_job(session, video_id, user), variant)
