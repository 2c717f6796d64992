"""Input files: images and videos uploaded once and referenced by id (``/v1/videos``'
``input_reference``), in the shape of OpenAI's ``/v1/files``.

Each user sees only their own files; another user's file id answers 404, like one that does not
exist. Every upload is decoded and checked before it is stored (`api.uploads`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Literal, cast

from fastapi import APIRouter, HTTPException, Path, Query, Request, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api import uploads
from api.deps import CurrentUser, SessionDep, SettingsDep, StoreDep
from api.errors import Refusal
from api.schemas import PURPOSE_KINDS, FileDeleted, FileList, FilePublic
from common.settings import Settings
from storage import input_files
from storage.media import Kind
from storage.tables import InputFile, User

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[str, Path(max_length=64, description="The file id, as the upload returned it.")]
_NOT_FOUND = "file not found"

_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {
                "file": {"type": "string", "format": "binary",
                         "description": "a PNG, JPEG or WebP image or an MP4 or WebM video"},
                "purpose": {"type": "string", "enum": list(PURPOSE_KINDS),
                            "default": "user_data",
                            "description": "the kind it must be: image (or vision), video, "
                                           "or either (user_data)"},
            },
        }}},
    }
}


def file_public(row: InputFile, settings: Settings) -> FilePublic:
    expires = (None if settings.retention_days == 0
               else int((row.created_at + timedelta(days=settings.retention_days)).timestamp()))
    return FilePublic(
        id=row.id, bytes=row.size_bytes, created_at=int(row.created_at.timestamp()),
        expires_at=expires, filename=row.filename, purpose=row.purpose,
        kind=cast(Kind, row.kind),  # checked when it was stored
        content_type=row.content_type, width=row.width, height=row.height,
        num_frames=row.num_frames, duration_seconds=row.duration_seconds)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=FilePublic,
             openapi_extra=_UPLOAD_BODY,
             responses={413: {"description": "The file is larger than max_upload_bytes"},
                        415: {"description": "Not a PNG, JPEG, WebP, MP4 or WebM file"},
                        422: {"description": "The file does not decode or is out of bounds"}})
async def upload_file(request: Request, user: CurrentUser, session: SessionDep,
                      settings: SettingsDep, store: StoreDep) -> FilePublic:
    """Uploads an image or a video; it is decoded and checked whole before anything is kept."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            "send the file as multipart/form-data, in a part named 'file'")
    form = await uploads.read_form(request, settings, max_fields=4)
    try:
        fields = dict(form.multi_items())
        if len(fields) != len(form.multi_items()):
            raise Refusal(422, "a field is given more than once", code="duplicate")
        for name in fields:
            if name not in ("file", "purpose"):
                raise Refusal(422, f"{name}: unknown field", param=name, code="extra_forbidden")
        upload = fields.get("file")
        if not isinstance(upload, UploadFile):
            raise Refusal(422, "file: required, as a file part of the form", param="file",
                          code="missing")
        purpose = fields.get("purpose", "user_data")
        if purpose not in PURPOSE_KINDS:
            raise Refusal(422, f"purpose: must be one of {', '.join(PURPOSE_KINDS)}",
                          param="purpose", code="invalid_value")
        found = await uploads.check_upload(upload, settings, param="file")
        if found.kind not in PURPOSE_KINDS[str(purpose)]:
            raise Refusal(422, f"file: purpose {purpose!r} takes "
                               f"{' or '.join(PURPOSE_KINDS[str(purpose)])} files; this is "
                               f"a {found.content_type} {found.kind}", param="file",
                          code="wrong_kind")

        def store_it() -> FilePublic:
            row = uploads.store_upload(session, store, user, upload, found, purpose=str(purpose))
            return file_public(row, settings)

        return await run_in_threadpool(store_it)
    finally:
        await form.close()  # the file part's temporary file


@router.get("", response_model=FileList)
def list_files(
    user: CurrentUser, session: SessionDep, settings: SettingsDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> FileList:
    """The caller's files, newest first unless ``order=asc``; ``after`` is a file id."""
    anchor = None
    if after is not None:
        anchor = input_files.get_input_file(session, after, user)
        if anchor is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, "after: no such file")
    rows, more = input_files.list_input_files(session, user, limit=limit, after=anchor,
                                              newest_first=order == "desc")
    data = [file_public(row, settings) for row in rows]
    return FileList(data=data, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None, has_more=more)


@router.get("/{file_id}", response_model=FilePublic)
def retrieve_file(file_id: FileId, user: CurrentUser, session: SessionDep,
                  settings: SettingsDep) -> FilePublic:
    return file_public(visible_file(session, file_id, user), settings)


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: FileId, user: CurrentUser, session: SessionDep,
                store: StoreDep) -> FileDeleted:
    """Deletes the file: its stored bytes, then its row."""
    row = visible_file(session, file_id, user)
    store.delete(row.storage_key)
    input_files.forget_input_file(session, row.id)
    return FileDeleted(id=row.id)


def visible_file(session: Session, file_id: str, user: User) -> InputFile:
    """The caller's file, or 404 -- also for another user's, so ids cannot be probed."""
    row = input_files.get_input_file(session, file_id, user)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, _NOT_FOUND)
    return row
