"""Uploaded inputs at the door: read from a multipart form under the size limit, decoded and
checked (`storage.media`), and only then stored, the object before its row.

A form's file parts stream into temporary files (Starlette keeps the first MiB in memory, the rest
on disk), and `api.errors.BodySizeLimit` cuts a body off at ``max_upload_bytes`` plus
`FORM_SLACK_BYTES`, so an oversize upload is refused without being held in memory; a refused
one leaves no row and no stored object.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path, PurePosixPath

from fastapi import HTTPException, Request, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.requests import ClientDisconnect

from api.errors import Refusal
from common.settings import Settings
from storage import media
from storage.input_files import new_file_id, new_input_file
from storage.outputs import OutputStore
from storage.tables import InputFile, User

# What a multipart form may carry besides its file (boundaries, part headers, small fields).
FORM_SLACK_BYTES = 64 * 1024
_STATUS = {"unsupported_type": status.HTTP_415_UNSUPPORTED_MEDIA_TYPE}


def body_limit(settings: Settings) -> int:
    """The request-body limit of a route that takes an upload."""
    return settings.max_upload_bytes + FORM_SLACK_BYTES


async def read_form(request: Request, settings: Settings, *, max_fields: int) -> FormData:
    """The request's multipart (or urlencoded) form, at most one file; 400 when malformed. The
    caller closes it (``await form.close()``), which removes the file parts' temporary files."""
    try:
        return await request.form(max_files=1, max_fields=max_fields,
                                  max_part_size=settings.max_body_bytes)
    except ClientDisconnect:
        raise
    except Exception as exc:  # the multipart parser's own errors: malformed input
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed form body: {exc}") from exc


async def check_upload(upload: UploadFile, settings: Settings, *, param: str) -> media.Media:
    """What ``upload`` is, decoded and checked under the settings' bounds; a `Refusal` naming
    ``param`` and the problem otherwise: 413 over ``max_upload_bytes``, 415 for a type that is
    not accepted (or contradicts the file's name), 422 for anything else."""
    size = _size(upload)
    if size > settings.max_upload_bytes:
        raise Refusal(status.HTTP_413_CONTENT_TOO_LARGE,
                      f"{param}: the file is {size:,} bytes; at most "
                      f"{settings.max_upload_bytes:,} are allowed", param=param,
                      code="file_too_large")
    try:
        # Decoding is CPU work: off the event loop.
        return await run_in_threadpool(media.check, upload.file, media.Limits.of(settings),
                                       filename=upload.filename,
                                       content_type=upload.content_type)
    except media.Rejected as exc:
        raise Refusal(_STATUS.get(exc.code, status.HTTP_422_UNPROCESSABLE_CONTENT),
                      f"{param}: {exc}", param=param, code=exc.code) from exc


def _size(upload: UploadFile) -> int:
    if upload.size is not None:
        return upload.size
    upload.file.seek(0, 2)
    size = upload.file.tell()
    upload.file.seek(0)
    return size


def store_upload(session: Session, store: OutputStore, owner: User, upload: UploadFile,
                 found: media.Media, *, purpose: str) -> InputFile:
    """Stores a checked upload: its bytes under its key, then its row (committed). A row that
    cannot be written takes the object with it."""
    row = new_input_file(owner, found, file_id=new_file_id(), purpose=purpose,
                         filename=upload.filename, size_bytes=_size(upload))
    # The store takes a path: the part may still be in memory.
    with tempfile.TemporaryDirectory(prefix="kiln-upload-") as tmp:
        path = Path(tmp) / "upload"
        upload.file.seek(0)
        with open(path, "wb") as out:
            shutil.copyfileobj(upload.file, out)
        store.put(row.storage_key, path)
    return _commit(session, store, row)


def _commit(session: Session, store: OutputStore, row: InputFile) -> InputFile:
    """Commits the row of an object already stored; a row that cannot be written takes the
    object with it."""
    try:
        session.add(row)
        session.commit()
    except BaseException:
        session.rollback()
        store.delete(row.storage_key)
        raise
    return row


def store_copy(session: Session, store: OutputStore, owner: User, key: str, limits: media.Limits,
               *, kind: str) -> InputFile:
    """An input file of ``owner``'s holding a copy of the stored object ``key`` (a video kiln
    rendered: the source of a remix, an edit or an extension), checked as an upload is. A copy,
    so the new job does not depend on the source's files, which their owner may delete."""
    with tempfile.TemporaryDirectory(prefix="kiln-copy-") as tmp:
        path = Path(tmp) / "source"
        with store.open(key) as src, open(path, "wb") as out:
            shutil.copyfileobj(src, out)
        with open(path, "rb") as file:
            found = media.check(file, limits, filename=PurePosixPath(key).name)
        if found.kind != kind:
            raise Refusal(status.HTTP_422_UNPROCESSABLE_CONTENT,
                          f"the source is a {found.kind}, not a {kind}", code="wrong_kind")
        row = new_input_file(owner, found, file_id=new_file_id(), purpose="user_data",
                             filename=PurePosixPath(key).name, size_bytes=path.stat().st_size)
        store.put(row.storage_key, path)
    return _commit(session, store, row)
