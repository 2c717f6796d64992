"""OpenAI-compatible video routes, so the official SDK's ``client.videos`` works against kiln.

Statuses map queued -> queued, running -> in_progress, succeeded -> completed, and every other
end (failed, cancelled, dead, expired) -> failed with ``error.code`` saying which. A job made here
is an ordinary kiln job: the native routes see it too. ``input_reference`` (a file, or the id of
an upload) is decoded and checked like an upload, then refused with a 400 naming it where the
model takes no input of its kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from redis import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from api import bodies, jobs, uploads
from api.deps import CurrentUser, RedisDep, SessionDep, SettingsDep, StoreDep
from api.errors import Refusal
from api.routes.jobs import IdempotencyKey, JobId, serve_output, visible_job
from api.schemas import PromptText, VideoCreate, VideoDeleted, VideoList, VideoPublic
from common import admission
from common.settings import Settings
from storage import input_files, lifecycle, media, pagination, queries
from storage.outputs import OutputStore
from storage.submission import JobSpec
from storage.tables import InputFile, Job, JobState, User

router = APIRouter(prefix="/v1/videos", tags=["openai-compatible"])



def _create_schema(reference: dict[str, Any]) -> dict[str, Any]:
    schema = VideoCreate.model_json_schema()
    schema["properties"]["input_reference"] = reference
    return schema


_FILE_ID = {"type": "object", "required": ["file_id"],
            "properties": {"file_id": {"type": "string"}},
            "description": "an earlier upload (POST /v1/files)"}
_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": _create_schema({"anyOf": [
                {"type": "string", "format": "binary",
                 "description": "a PNG, JPEG or WebP image or an MP4 or WebM video"},
                _FILE_ID]})},
            "application/json": {"schema": _create_schema(_FILE_ID)},
        },
    }
}


# input_reference as the OpenAI SDK sends it: a file part, or {"file_id": ...} (in a form,
# "input_reference[file_id]"); an image_url, which kiln would have to fetch, is not taken.
Reference = UploadFile | str


async def _read_json(request: Request, settings: Settings) -> dict[str, Any]:
    # This route's body limit is an upload's (api.uploads.body_limit); JSON holds no file, so
    # it is held to max_body_bytes as it arrives.
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > settings.max_body_bytes:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                f"request body is larger than the {settings.max_body_bytes} "
                                f"bytes allowed")
        chunks.append(chunk)
    try:
        data = bodies.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestValidationError(
            [{"loc": ("body",), "msg": "body is not valid JSON", "type": "json_invalid"}]
        ) from exc
    if not isinstance(data, dict):
        raise RequestValidationError(
            [{"loc": ("body",), "msg": "must be a JSON object", "type": "model_type"}])
    return data


async def _read_form(request: Request, settings: Settings) -> tuple[FormData, dict[str, Any]]:
    form = await uploads.read_form(request, settings, max_fields=32)
    data: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if key in data:
                raise RequestValidationError(
                    [{"loc": ("body", key), "msg": "given more than once", "type": "duplicate"}])
            if isinstance(value, UploadFile) and key != "input_reference":
                raise RequestValidationError([{"loc": ("body", key), "type": "unsupported",
                                               "msg": "only input_reference takes a file"}])
            data[key] = value
    except BaseException:
        await form.close()
        raise
    return form, data


def _pop_reference(raw: dict[str, Any]) -> Reference | None:
    """Takes ``input_reference`` out of the body: the file part, or the file id of
    ``{"file_id": ...}`` (``input_reference[file_id]`` in a form)."""
    keys = [k for k in raw if k == "input_reference" or k.startswith("input_reference[")]
    if not keys:
        return None
    if len(keys) > 1:
        raise Refusal(422, "input_reference: give a file or a file_id, once",
                      param="input_reference", code="duplicate")
    key, value = keys[0], raw.pop(keys[0])
    if key == "input_reference" and isinstance(value, UploadFile):
        return value
    if key == "input_reference" and isinstance(value, dict) and set(value) == {"file_id"}:
        value = value["file_id"]
    elif key != "input_reference[file_id]":
        raise Refusal(400, 'input_reference: give a file, or {"file_id": ...} of an upload '
                           "(POST /v1/files); kiln fetches no image_url",
                      param="input_reference", code="unsupported_parameter")
    if not isinstance(value, str) or not value:
        raise Refusal(422, "input_reference: file_id must be a non-empty string",
                      param="input_reference", code="invalid_type")
    return value


async def _check_reference(reference: Reference, session: Session, user: User,
                           settings: Settings) -> tuple[str, media.Media | None]:
    """The kind ("image", "video") of a valid reference, and what an upload decoded to; the
    refusal of a bad one: an upload's own (`api.uploads.check_upload`), or 404 for a file id
    the caller does not own."""
    if isinstance(reference, UploadFile):
        found = await uploads.check_upload(reference, settings, param="input_reference")
        return found.kind, found
    row = await run_in_threadpool(input_files.get_input_file, session, reference, user)
    if row is None:
        raise Refusal(404, "input_reference: file not found", param="input_reference",
                      code="file_not_found")
    return row.kind, None


def _refuse_unconditioned(settings: Settings, model: str, kind: str | None) -> None:
    """400 in the OpenAI shape when ``model`` cannot take a ``kind`` input, naming the models
    of this deployment that can; or, with no input (``kind`` None), when it renders only from
    one."""
    family = admission.family_for(settings, model)
    if kind is None:
        if family.needs_input:
            raise Refusal(400, f"input_reference: model {model!r} renders from an input; give "
                               f"{' or '.join(map(admission.a, sorted(family.inputs)))}",
                          param="input_reference", code="missing_required_parameter")
        return
    if kind in family.inputs:
        return
    able = admission.models_taking(settings, kind)
    hint = (f"models that take one: {', '.join(able)}" if able
            else "no model of this deployment takes one")
    raise Refusal(400, f"input_reference: model {model!r} cannot take "
                       f"{admission.a(kind)} input; {hint}",
                  param="input_reference", code="unsupported_parameter")


@router.post("", response_model=VideoPublic, openapi_extra=_CREATE_BODY,
             responses={400: {"description": "The model cannot take input_reference"},
                        409: {"description": "Idempotency-Key reused with another body"},
                        413: {"description": "input_reference is larger than max_upload_bytes"},
                        415: {"description": "input_reference is not an accepted type"},
                        429: {"description": "Too many queued jobs; see Retry-After"}})
async def create_video(request: Request, user: CurrentUser, session: SessionDep,
                       redis: RedisDep, settings: SettingsDep, store: StoreDep,
                       response: Response,
                       idempotency_key: IdempotencyKey = None) -> VideoPublic:
    """The SDK sends multipart/form-data; plain clients may send JSON or a urlencoded form. An
    ``input_reference`` is decoded and checked before the model is asked whether it takes one,
    so a bad file gets its own refusal."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    form = None
    if content_type == "application/json":
        raw = await _read_json(request, settings)
    elif content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form, raw = await _read_form(request, settings)
    else:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            "send multipart/form-data or application/json")
    uploaded = None  # an input_reference file stored for this request
    try:
        reference = _pop_reference(raw)
        try:
            body = VideoCreate.model_validate(raw)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            ) from exc
        spec = jobs.spec_from_video_create(body, settings, jobs.now())
        hashed = body.model_dump(mode="json")
        if reference is None:
            _refuse_unconditioned(settings, spec.model, None)
        else:
            kind, found = await _check_reference(reference, session, user, settings)
            _refuse_unconditioned(settings, spec.model, kind)
            if isinstance(reference, UploadFile):
                assert found is not None
                hashed["input_reference"] = await run_in_threadpool(_digest, reference)
                uploaded = await run_in_threadpool(uploads.store_upload, session, store, user,
                                                   reference, found, purpose="user_data")
                reference = uploaded.id
            else:
                hashed["input_reference"] = reference
            spec = dataclasses.replace(spec, input_file_id=reference, input_fit="crop")
    finally:
        if form is not None:
            await form.close()  # uploaded parts are temporary files
    digest = jobs.request_hash("video", hashed)

    def submit() -> VideoPublic:
        try:
            created, _ = jobs.submit(session, redis, settings, user, spec,
                                     request_hash=digest, idempotency_key=idempotency_key,
                                     room=request.app.state.queue_room)
        except BaseException:
            _forget(uploaded)
            raise
        if not created.created:
            _forget(uploaded)  # the replayed job has its own input
            response.headers["Idempotent-Replayed"] = "true"
        return jobs.video_public(created.job, retention_days=settings.retention_days)

    def _forget(row: InputFile | None) -> None:
        if row is not None:
            store.delete(row.storage_key)
            input_files.forget_input_file(session, row.id)

    # The database and Redis clients block; keep them off the event loop.
    return await run_in_threadpool(submit)


def _digest(upload: UploadFile) -> str:
    """sha256 of an uploaded file: what an idempotent replay of the request must send again."""
    upload.file.seek(0)
    h = hashlib.sha256()
    for chunk in iter(lambda: upload.file.read(1 << 20), b""):
        h.update(chunk)
    upload.file.seek(0)
    return f"sha256:{h.hexdigest()}"


@router.get("", response_model=VideoList)
def list_videos(
    user: CurrentUser, session: SessionDep, settings: SettingsDep,
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
    data = [jobs.video_public(j, retention_days=settings.retention_days) for j in page]
    return VideoList(data=data, first_id=data[0].id if data else None,
                     last_id=data[-1].id if data else None, has_more=next_cursor is not None)


@router.get("/{video_id}", response_model=VideoPublic)
def retrieve_video(video_id: JobId, user: CurrentUser, session: SessionDep,
                   settings: SettingsDep) -> VideoPublic:
    return jobs.video_public(visible_job(session, video_id, user),
                             retention_days=settings.retention_days)


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


# Remix, edit and extend: a new video made from an earlier one (a video of the caller's, by id)
# or from an uploaded clip. The source is copied into an input file of the caller's, so the new
# job depends on nothing the caller might delete meanwhile, and goes through the same checks,
# queue and ranks as any job with an input.

_PROMPT = TypeAdapter(PromptText)


class VideoRemix(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: PromptText


def _model_for(settings: Settings, kind: str, preferred: str | None, param: str,
               what: str) -> str:
    """The model that serves a ``what`` (it takes a ``kind`` input): ``preferred`` when it can,
    else this deployment's first that can; the OpenAI-shaped 400 when none can."""
    able = admission.models_taking(settings, kind)
    if preferred in able:
        return preferred
    if able:
        return able[0]
    raise Refusal(400, f"{param}: no model of this deployment can {what} (it needs a model "
                       f"that takes {admission.a(kind)} input)", param=param,
                  code="unsupported_parameter")


def _completed_source(session: Session, user: User, video_id: str, param: str) -> Job:
    """The caller's completed video ``video_id``; 404 for one that is not theirs, 400 for one
    with no video to start from."""
    source = queries.get_job(session, video_id, user)
    if source is None:
        raise Refusal(404, f"{param}: video not found", param=param, code="video_not_found")
    if source.state != JobState.SUCCEEDED.value or source.output_video_key is None:
        raise Refusal(400, f"{param}: video {video_id} is {source.state}; only a completed "
                           "video can be remixed, edited or extended", param=param,
                      code="invalid_video")
    return source


def _derived_spec(settings: Settings, model: str, prompt: str, *, like: Job | None,
                  num_frames: int | None = None, param: str) -> JobSpec:
    """The spec of a video made from another: the source job's size, length, frame rate, steps
    and guidance where there is one and ``model`` is its model, else ``model``'s defaults; held
    to the same rules as any request."""
    d = jobs.request_defaults(settings, model)
    same = like if like is not None and like.model == model else None
    fields = {name: getattr(d if same is None else same, name) for name in (
        "width", "height", "num_frames", "fps", "num_inference_steps", "guidance_scale")}
    if num_frames is not None:
        fields["num_frames"] = num_frames
    spec = JobSpec(model=model, prompt=prompt, seed=None if same is None else same.seed,
                   negative_prompt=None if same is None else same.negative_prompt, **fields)
    problems = admission.request_problems(settings, spec, model=model)
    if problems:
        raise Refusal(400, f"{param}: {problems[0]}", param=param, code="invalid_value")
    return spec


async def _submit_derived(request: Request, session: Session, redis: Redis, store: OutputStore,
                          settings: Settings, user: User, spec: JobSpec, *, kind: str,
                          source: Job | None, upload: UploadFile | None,
                          found: media.Media | None, digest_body: dict[str, Any],
                          idempotency_key: str | None, response: Response) -> VideoPublic:
    """Stores the input (the source job's video, or the upload), then the job; a job that is
    not created (refused, or an idempotent replay) takes its stored input with it."""

    def run() -> VideoPublic:
        if upload is not None:
            assert found is not None
            row = uploads.store_upload(session, store, user, upload, found, purpose="user_data")
        else:
            assert source is not None and source.output_video_key is not None
            row = uploads.store_copy(session, store, user, source.output_video_key,
                                     media.Limits.of(settings), kind=kind)
        derived = dataclasses.replace(spec, input_file_id=row.id, input_fit="crop",
                                      source_job_id=source.id if source else None)
        try:
            created, _ = jobs.submit(session, redis, settings, user, derived,
                                     request_hash=jobs.request_hash("video", digest_body),
                                     idempotency_key=idempotency_key,
                                     room=request.app.state.queue_room)
        except BaseException:
            store.delete(row.storage_key)
            input_files.forget_input_file(session, row.id)
            raise
        if not created.created:
            store.delete(row.storage_key)
            input_files.forget_input_file(session, row.id)
            response.headers["Idempotent-Replayed"] = "true"
        return jobs.video_public(created.job, retention_days=settings.retention_days)

    return await run_in_threadpool(run)


@router.post("/{video_id}/remix", response_model=VideoPublic,
             responses={400: {"description": "No model of this deployment can remix"}})
async def remix_video(video_id: JobId, body: VideoRemix, request: Request, user: CurrentUser,
                      session: SessionDep, redis: RedisDep, settings: SettingsDep,
                      store: StoreDep, response: Response,
                      idempotency_key: IdempotencyKey = None) -> VideoPublic:
    """A new video of a completed one with a new prompt: video-to-video from it, at its size
    and length (and its model, where that model takes a video)."""
    source = await run_in_threadpool(_completed_source, session, user, video_id, "video_id")
    model = _model_for(settings, "video", source.model, "video_id", "remix a video")
    spec = _derived_spec(settings, model, body.prompt, like=source, param="prompt")
    return await _submit_derived(
        request, session, redis, store, settings, user, spec, kind="video", source=source,
        upload=None, found=None,
        digest_body={"remix": video_id, "prompt": body.prompt},
        idempotency_key=idempotency_key, response=response)


async def _video_reference(request: Request, settings: Settings, *,
                           fields: tuple[str, ...]) -> tuple[FormData, dict[str, Any],
                                                             UploadFile | str]:
    """The form of an edit or an extension: its fields, and ``video`` as the SDK sends it (a
    file part, or ``video[id]`` naming a completed video of the caller's)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send multipart/form-data")
    form = await uploads.read_form(request, settings, max_fields=16)
    try:
        data: dict[str, Any] = {}
        for key, value in form.multi_items():
            if key in data:
                raise Refusal(422, f"{key}: given more than once", param=key, code="duplicate")
            data[key] = value
        video = data.pop("video", None)
        video_id = data.pop("video[id]", None)
        if (video is None) == (video_id is None):
            raise Refusal(422, 'video: give a file, or {"id": ...} of a completed video, once',
                          param="video", code="missing")
        if video is not None and not isinstance(video, UploadFile):
            raise Refusal(422, "video: must be a file part", param="video", code="invalid_type")
        if video_id is not None and (not isinstance(video_id, str) or not video_id):
            raise Refusal(422, "video: id must be a non-empty string", param="video",
                          code="invalid_type")
        for key in data:
            if key not in fields:
                raise Refusal(422, f"{key}: unknown field", param=key, code="extra_forbidden")
            if not isinstance(data[key], str):
                raise Refusal(422, f"{key}: must be text", param=key, code="invalid_type")
        try:
            _PROMPT.validate_python(data.get("prompt"))
        except ValidationError as exc:
            raise Refusal(422, f"prompt: {exc.errors()[0]['msg']}", param="prompt",
                          code="invalid_value") from exc
        if not data["prompt"].strip():
            raise Refusal(422, "prompt: must not be blank", param="prompt", code="invalid_value")
    except BaseException:
        await form.close()
        raise
    return form, data, video if video is not None else cast(str, video_id)  # one is given


async def _clip_source(reference: UploadFile | str, session: Session, user: User,
                       settings: Settings) -> tuple[Job | None, UploadFile | None,
                                                    media.Media | None, str]:
    """An edit's or an extension's ``video``: (the completed video of the caller's it names, or
    None; the upload, checked and a clip, or None; what the upload decoded to; what the
    request's digest records of it: the video's id, or the upload's sha256)."""
    if isinstance(reference, UploadFile):
        found = await uploads.check_upload(reference, settings, param="video")
        if found.kind != "video":
            raise Refusal(422, f"video: this is a {found.content_type} image; give a clip",
                          param="video", code="wrong_kind")
        return None, reference, found, await run_in_threadpool(_digest, reference)
    source = await run_in_threadpool(_completed_source, session, user, reference, "video")
    return source, None, None, reference


def _clip_body(**fields: dict[str, str]) -> dict[str, Any]:
    """The OpenAPI request body of an edit or an extension: a prompt, ``fields``, and the
    ``video`` (a clip, or ``video[id]``)."""
    properties = {"prompt": {"type": "string"}, **fields,
                  "video": {"type": "string", "format": "binary",
                            "description": "an MP4 or WebM clip; or video[id], the id of a "
                                           "completed video"}}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": list(properties), "properties": properties}}}}}


@router.post("/edits", response_model=VideoPublic, openapi_extra=_clip_body(),
             responses={400: {"description": "No model of this deployment can edit"}})
async def edit_video(request: Request, user: CurrentUser, session: SessionDep,
                     redis: RedisDep, settings: SettingsDep, store: StoreDep,
                     response: Response,
                     idempotency_key: IdempotencyKey = None) -> VideoPublic:
    """A video restyled by a prompt: video-to-video from an uploaded clip or a completed video
    of the caller's."""
    form, data, reference = await _video_reference(request, settings, fields=("prompt",))
    try:
        prompt = data["prompt"]
        source, upload, found, named = await _clip_source(reference, session, user, settings)
        digest = {"edit": named, "prompt": prompt}
        model = _model_for(settings, "video", source.model if source else None, "video",
                           "edit a video")
        spec = _derived_spec(settings, model, prompt, like=source, param="prompt")
        return await _submit_derived(
            request, session, redis, store, settings, user, spec, kind="video",
            source=source, upload=upload, found=found, digest_body=digest,
            idempotency_key=idempotency_key, response=response)
    finally:
        await form.close()


@router.post("/extensions", response_model=VideoPublic,
             openapi_extra=_clip_body(seconds={"type": "string",
                                               "description": "of the new part"}),
             responses={400: {"description": "No model of this deployment can extend"}})
async def extend_video(request: Request, user: CurrentUser, session: SessionDep,
                       redis: RedisDep, settings: SettingsDep, store: StoreDep,
                       response: Response,
                       idempotency_key: IdempotencyKey = None) -> VideoPublic:
    """A video continued: ``seconds`` more, rendered from its last frame and written after it
    as one video. Needs a model that takes an image (image-to-video)."""
    form, data, reference = await _video_reference(request, settings,
                                                   fields=("prompt", "seconds"))
    try:
        prompt, seconds_text = data["prompt"], data.get("seconds", "")
        if not seconds_text.isdigit() or not 1 <= int(seconds_text) <= 60:
            raise Refusal(422, "seconds: a whole number of seconds from 1 to 60",
                          param="seconds", code="invalid_value")
        source, upload, found, named = await _clip_source(reference, session, user, settings)
        digest = {"extend": named, "prompt": prompt, "seconds": seconds_text}
        model = _model_for(settings, "image", source.model if source else None, "video",
                           "extend a video")
        family = admission.family_for(settings, model)
        like_fps = source.fps if source is not None and source.model == model else (
            jobs.request_defaults(settings, model).fps)
        stride, base = admission.frame_stride(settings, family), family.frame_base
        # The new part starts with the source's last frame, written once: 1 + seconds x fps
        # frames, rounded up to the model's rule.
        wanted = 1 + int(seconds_text) * like_fps
        frames = max(family.min_frames, base + -(-(wanted - base) // stride) * stride)
        spec = _derived_spec(settings, model, prompt, like=source, num_frames=frames,
                             param="seconds")
        spec = dataclasses.replace(spec, input_role="extend")
        return await _submit_derived(
            request, session, redis, store, settings, user, spec, kind="video",
            source=source, upload=upload, found=found, digest_body=digest,
            idempotency_key=idempotency_key, response=response)
    finally:
        await form.close()
