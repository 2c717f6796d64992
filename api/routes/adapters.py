"""LoRA adapters: ``.safetensors`` files registered once, by name, for one model, and named by
jobs (``adapters: [{id, scale}]``).

Each upload is checked against the model's transformer before anything is kept: its keys must
name the model's Linears, its shapes and ranks fit them, in a layout diffusers' loader of the
family accepts (`runtime.adapter_check`); a 422 names the first problem. Its bytes are stored
under their sha256 (`storage.outputs.adapter_key`). A user sees their own adapters and the shared
ones an admin registered (``shared=true``); another user's adapter id answers 404, like one that
does not exist.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api import uploads
from api.deps import CurrentUser, SessionDep, SettingsDep, StoreDep
from api.errors import Refusal
from api.schemas import ADAPTER_NAME, AdapterDeleted, AdapterList, AdapterPublic
from storage import adapters
from storage.outputs import OutputStore
from storage.tables import LoraAdapter, User

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

AdapterId = Annotated[str, PathParam(max_length=64, description="The adapter's id.")]
_NOT_FOUND = "adapter not found"

_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file", "name"],
            "properties": {
                "file": {"type": "string", "format": "binary",
                         "description": "a LoRA .safetensors file, in a layout diffusers' "
                                        "loader of the model's family reads"},
                "name": {"type": "string", "pattern": ADAPTER_NAME,
                         "description": "unique among your adapters (or the shared ones)"},
                "model": {"type": "string", "description": "the model it adapts; left out: "
                                                           "the default model"},
                "shared": {"type": "boolean", "default": False,
                           "description": "admins only: every user may use it"},
            },
        }}},
    }
}


def adapter_public(row: LoraAdapter) -> AdapterPublic:
    return AdapterPublic(id=row.id, name=row.name, model=row.model, family=row.family,
                         rank=row.rank, bytes=row.size_bytes, sha256=row.sha256,
                         shared=row.owner_id is None,
                         created_at=int(row.created_at.timestamp()))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=AdapterPublic,
             openapi_extra=_UPLOAD_BODY,
             responses={403: {"description": "shared=true from a user who is not an admin"},
                        409: {"description": "The name is taken"},
                        413: {"description": "The file is larger than max_upload_bytes"},
                        422: {"description": "Not a safetensors LoRA for the model: the "
                                             "first mismatch is named"}})
async def register_adapter(request: Request, user: CurrentUser, session: SessionDep,
                           settings: SettingsDep, store: StoreDep) -> AdapterPublic:
    """Registers a LoRA file for a model; it is checked whole before anything is kept."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            "send the file as multipart/form-data, in a part named 'file'")
    form = await uploads.read_form(request, settings, max_fields=8)
    try:
        fields = dict(form.multi_items())
        if len(fields) != len(form.multi_items()):
            raise Refusal(422, "a field is given more than once", code="duplicate")
        for key in fields:
            if key not in ("file", "name", "model", "shared"):
                raise Refusal(422, f"{key}: unknown field", param=key, code="extra_forbidden")
        upload = fields.get("file")
        if not isinstance(upload, UploadFile):
            raise Refusal(422, "file: required, as a file part of the form", param="file",
                          code="missing")
        name, model = fields.get("name"), fields.get("model") or settings.default_model
        if not isinstance(name, str) or not re.match(ADAPTER_NAME, name):
            raise Refusal(422, "name: required: 1 to 100 letters, digits, '.', '_' or '-', "
                               "starting with a letter or digit", param="name",
                          code="invalid_value")
        if not isinstance(model, str) or model not in settings.models:
            raise Refusal(422, f"model: unknown model {model!r}; available: "
                               f"{', '.join(settings.models)}", param="model",
                          code="invalid_value")
        shared = str(fields.get("shared", "false")).lower()
        if shared not in ("true", "false"):
            raise Refusal(422, "shared: true or false", param="shared", code="invalid_value")
        if shared == "true" and not user.is_admin:
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                "shared: only admins register shared adapters")
        size = upload.size
        if size is None:  # counted by seeking, not by reading the file into memory
            size = upload.file.seek(0, 2)
            upload.file.seek(0)
        if size > settings.max_upload_bytes:
            raise Refusal(status.HTTP_413_CONTENT_TOO_LARGE,
                          f"file: the file is {size:,} bytes; at most "
                          f"{settings.max_upload_bytes:,} are allowed", param="file",
                          code="file_too_large")
        owner = None if shared == "true" else user

        def check_and_store() -> AdapterPublic:
            return adapter_public(_register(session, store, owner, upload, name=name,
                                            model=model))

        return await run_in_threadpool(check_and_store)
    finally:
        await form.close()  # the file part's temporary file


def _register(session: Session, store: OutputStore, owner: User | None, upload: UploadFile, *,
              name: str, model: str) -> LoraAdapter:
    """Checks the upload against ``model``, stores its bytes (unless a registration already
    holds them), then its row; a row that cannot be written takes a new object with it."""
    if adapters.find_by_name(session, name, owner) is not None:
        raise Refusal(409, f"name: {'a shared' if owner is None else 'your'} adapter "
                           f"{name!r} exists; delete it first or choose another name",
                      param="name", code="name_taken")
    # Here, not at the top: the check builds the model's transformer (on the meta device, no
    # weights) with torch, which an API process that registers no adapter never loads.
    from runtime.adapter_check import check_adapter_file

    with tempfile.TemporaryDirectory(prefix="kiln-adapter-") as tmp:
        path = Path(tmp) / "adapter.safetensors"
        upload.file.seek(0)
        with open(path, "wb") as out:
            shutil.copyfileobj(upload.file, out)
        try:
            checked = check_adapter_file(path, model)
        except ValueError as exc:
            message = str(exc).replace(f"{path}: ", "").replace(str(path), "the file")
            raise Refusal(422, f"file: {message}", param="file", code="invalid_adapter") from exc
        row = adapters.new_adapter(owner, name=name, model=model, family=checked.family,
                                   rank=checked.rank, sha256=checked.sha256,
                                   size_bytes=checked.size_bytes)
        fresh = not store.exists(row.storage_key)
        if fresh:
            store.put(row.storage_key, path)
    try:
        session.add(row)
        session.commit()
    except IntegrityError as exc:  # the same name, registered meanwhile
        session.rollback()
        if fresh:
            store.delete(row.storage_key)
        raise Refusal(409, f"name: {name!r} is taken", param="name", code="name_taken") from exc
    except BaseException:
        session.rollback()
        if fresh:
            store.delete(row.storage_key)
        raise
    return row


@router.get("", response_model=AdapterList)
def list_adapters(
    user: CurrentUser, session: SessionDep,
    model: Annotated[str | None, Query(max_length=100)] = None,
) -> AdapterList:
    """Your adapters and the shared ones (for ``model`` only, if given), by name."""
    return AdapterList(data=[adapter_public(row) for row in
                             adapters.list_adapters(session, user, model=model)])


@router.get("/{adapter_id}", response_model=AdapterPublic)
def retrieve_adapter(adapter_id: AdapterId, user: CurrentUser,
                     session: SessionDep) -> AdapterPublic:
    return adapter_public(visible_adapter(session, adapter_id, user))


@router.delete("/{adapter_id}", response_model=AdapterDeleted)
def delete_adapter(adapter_id: AdapterId, user: CurrentUser, session: SessionDep,
                   store: StoreDep) -> AdapterDeleted:
    """Deletes the adapter (a shared one: admins only); its bytes go with its last
    registration. Queued jobs that name it fail when claimed; new ones are refused."""
    row = visible_adapter(session, adapter_id, user)
    if row.owner_id is None and not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            "only admins delete shared adapters")
    if adapters.forget_adapter(session, row):
        store.delete(row.storage_key)
    return AdapterDeleted(id=row.id)


def visible_adapter(session: Session, adapter_id: str, user: User) -> LoraAdapter:
    """The caller's adapter or a shared one, or 404 -- also for another user's, so ids cannot
    be probed."""
    row = adapters.get_adapter(session, adapter_id, user)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, _NOT_FOUND)
    return row

