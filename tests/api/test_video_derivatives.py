"""Videos made from videos, the OpenAI way: remix (a completed video of the caller's, a new
prompt), edit (a clip or a completed video restyled) and extend (more seconds after a clip). A
source is copied into an input file of the caller's before the job is stored; a refused request
leaves no row, no stored file and no Redis key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_settings
from fastapi.testclient import TestClient
from media_files import png, video
from sqlalchemy import func, select

from api.app import create_app
from storage.tables import InputFile, Job


def _stored(api) -> list[str]:  # noqa: ANN001
    root = Path(api.store.root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) \
        if root.exists() else []


def _rows(api) -> tuple[int, int]:  # noqa: ANN001
    with api.session() as s:
        return (s.scalar(select(func.count()).select_from(InputFile)),
                s.scalar(select(func.count()).select_from(Job)))


def _completed(api, who: str = "alice") -> str:  # noqa: ANN001
    """A finished kiln-tiny video of ``who``'s with a real MP4 (64x64, 9 frames, 8 fps)."""
    r = api.client.post("/v1/jobs", headers=api.auth(who), json={"prompt": "a red circle"})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    api.finish(job_id, video=video(frames=9, size=64))
    return job_id


def _post(api, path: str, who: str = "alice", **kwargs: Any):  # noqa: ANN001, ANN202
    return api.client.post(path, headers=api.auth(who), **kwargs)


@pytest.fixture
def big_only(api, tmp_path: Path) -> Iterator[Any]:  # noqa: ANN001
    """The `api` fixture's app serving kiln-big alone: a model that takes no input."""
    api.settings = make_settings(api.db.url, api.settings.redis_prefix, tmp_path,
                                 models=["kiln-big"])
    api.app = create_app(api.settings, engine=api.db.engine, redis=api.redis, store=api.store)
    with TestClient(api.app, raise_server_exceptions=True) as client:
        api.client = client
        yield api


def test_remix_edit_and_extend_without_a_model_that_can_are_openai_400s(big_only) -> None:  # noqa: ANN001
    api = big_only
    source = _completed(api)
    before = _rows(api), _stored(api)
    r = _post(api, f"/v1/videos/{source}/remix", json={"prompt": "a blue square"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "video_id: no model of this deployment can remix a video (it needs a model "
                   "that takes a video input)",
        "param": "video_id", "code": "unsupported_parameter", "type": "invalid_request_error"}
    r = _post(api, "/v1/videos/edits", data={"prompt": "in blue", "video[id]": source})
    assert r.status_code == 400 and r.json()["error"]["param"] == "video", r.text
    r = _post(api, "/v1/videos/edits", data={"prompt": "in blue"},
              files={"video": ("clip.mp4", video(), "video/mp4")})
    assert r.status_code == 400 and "can edit a video" in r.json()["detail"], r.text
    r = _post(api, "/v1/videos/extensions", data={"prompt": "on", "seconds": "1",
                                                  "video[id]": source})
    assert r.status_code == 400 and "can extend a video" in r.json()["detail"], r.text
    assert (_rows(api), _stored(api)) == before


def test_a_remix_is_video_to_video_from_a_copy_of_the_source_at_its_size(api) -> None:  # noqa: ANN001
    source = _completed(api)
    r = _post(api, f"/v1/videos/{source}/remix", json={"prompt": "a blue square"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["remixed_from_video_id"] == source and body["size"] == "64x64"
    with api.session() as s:
        job, src = s.get(Job, body["id"]), s.get(Job, source)
        copy = s.get(InputFile, job.input_file_id)
        assert (job.model, job.num_frames, job.seed, job.source_job_id, job.input_role) == (
            src.model, src.num_frames, src.seed, source, None)
        assert copy.kind == "video" and copy.storage_key != src.output_video_key
    # The copy is the caller's own: deleting the source leaves it.
    assert api.client.delete(f"/v1/videos/{source}", headers=api.auth("alice")).status_code \
        == 200
    assert (Path(api.store.root) / copy.storage_key).is_file()


def test_an_edit_of_an_upload_and_an_extension_of_a_video(api) -> None:  # noqa: ANN001
    r = _post(api, "/v1/videos/edits", data={"prompt": "in blue"},
              files={"video": ("clip.mp4", video(frames=5, size=64), "video/mp4")})
    assert r.status_code == 200 and r.json()["remixed_from_video_id"] is None, r.text
    source = _completed(api)
    r = _post(api, "/v1/videos/extensions", data={"prompt": "on", "seconds": "2",
                                                  "video[id]": source})
    assert r.status_code == 200, r.text
    with api.session() as s:
        job = s.get(Job, r.json()["id"])
        # kiln-tiny at 8 fps: 1 + 2 x 8 new frames, rendered from the source's last frame.
        assert (job.input_role, job.num_frames, job.source_job_id) == ("extend", 17, source)


@pytest.mark.parametrize("path,fields,status,reason", [
    ("/v1/videos/{other}/remix", None, 404, "video_id: video not found"),
    ("/v1/videos/{queued}/remix", None, 400, "video_id: video {queued} is queued"),
    ("/v1/videos/edits", {"prompt": "p"}, 422, "video: give a file"),
    ("/v1/videos/edits", {"prompt": "p", "video[id]": "{other}"}, 404, "video: video not found"),
    ("/v1/videos/edits", {"prompt": " ", "video[id]": "{mine}"}, 422, "prompt: must not be"),
    ("/v1/videos/edits", {"prompt": "p", "video[id]": "{mine}", "size": "64x64"}, 422,
     "size: unknown field"),
    ("/v1/videos/extensions", {"prompt": "p", "seconds": "0", "video[id]": "{mine}"}, 422,
     "seconds: a whole number"),
    ("/v1/videos/extensions", {"prompt": "p", "seconds": "x", "video[id]": "{mine}"}, 422,
     "seconds: a whole number"),
])
def test_bad_sources_and_fields_are_refused_naming_them(api, path: str,  # noqa: ANN001
                                                         fields: dict[str, str] | None,
                                                         status: int, reason: str) -> None:
    ids = {"mine": _completed(api), "other": _completed(api, "bob")}
    r = _post(api, "/v1/jobs", json={"prompt": "later"})
    ids["queued"] = r.json()["id"]
    before = _rows(api), _stored(api)
    url = path.format(**ids)
    if fields is None:
        r = _post(api, url, json={"prompt": "a blue square"})
    else:
        r = _post(api, url, data={k: v.format(**ids) for k, v in fields.items()})
    assert (r.status_code, r.json()["detail"][:len(reason.format(**ids))]) == (
        status, reason.format(**ids)), r.text
    assert (_rows(api), _stored(api)) == before


def test_an_edit_of_an_image_is_refused_as_the_wrong_kind(api) -> None:  # noqa: ANN001
    r = _post(api, "/v1/videos/edits", data={"prompt": "p"},
              files={"video": ("a.png", png(), "image/png")})
    assert r.status_code == 422 and r.json()["detail"].startswith("video: this is a image/png"), \
        r.text
    assert _rows(api) == (0, 0) and _stored(api) == []
