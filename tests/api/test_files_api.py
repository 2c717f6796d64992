"""/v1/files and /v1/videos' input_reference: uploads decoded and checked before anything is
kept, per user; every hostile input gets a 4xx naming the problem and leaves no row, no Redis key
and no stored file behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import make_settings
from fastapi.testclient import TestClient
from media_files import jpeg, mp4_of_repeated_frames, png, png_declaring, video, webp
from servers import Server
from sqlalchemy import func, select

from api.app import create_app
from storage.tables import InputFile, Job

pytestmark = pytest.mark.filterwarnings(
    # The SDK marks its video methods deprecated for OpenAI's own service; kiln is unaffected.
    "ignore:The Sora API is scheduled:DeprecationWarning"
)

UPLOAD_LIMIT = 4 * 1024 * 1024


@pytest.fixture
def files_api(api, tmp_path: Path) -> Iterator[Any]:  # noqa: ANN001
    """The `api` fixture's app with the upload bounds of these tests: 4 MiB, 900 frames."""
    api.settings = make_settings(api.db.url, api.settings.redis_prefix, tmp_path,
                                 max_upload_bytes=UPLOAD_LIMIT)
    api.app = create_app(api.settings, engine=api.db.engine, redis=api.redis, store=api.store)
    with TestClient(api.app, raise_server_exceptions=True) as client:
        api.client = client
        yield api


def upload(api, who: str, name: str, data: bytes, content_type: str = "application/octet-stream",
           **fields: str) -> Any:  # noqa: ANN001
    return api.client.post("/v1/files", headers=api.auth(who), data=fields,
                           files={"file": (name, data, content_type)})


def stored(api) -> list[str]:  # noqa: ANN001
    """Every file under the store's directory, temporary ones included."""
    root = Path(api.store.root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) \
        if root.exists() else []


def redis_keys(api) -> list[bytes]:  # noqa: ANN001
    """The keys under the test's prefix, besides the queue index's own "built" mark (set when the
    app started)."""
    return sorted(k for k in api.redis.scan_iter(match=f"{api.settings.redis_prefix}*",
                                                 count=1000) if not k.endswith(b":sched:built"))


def rows(api) -> tuple[int, int]:  # noqa: ANN001
    with api.session() as s:
        return (s.scalar(select(func.count()).select_from(InputFile)),
                s.scalar(select(func.count()).select_from(Job)))


def test_an_upload_is_described_listed_and_deleted_by_its_owner_only(files_api) -> None:  # noqa: ANN001
    api = files_api
    r = upload(api, "alice", "photo.jpg", jpeg(40, 24, orientation=6), "image/jpeg",
               purpose="vision")
    assert r.status_code == 201, r.text
    photo = r.json()
    assert {k: photo[k] for k in ("object", "kind", "content_type", "width", "height",
                                  "num_frames", "duration_seconds", "filename", "purpose",
                                  "status")} == {
        "object": "file", "kind": "image", "content_type": "image/jpeg", "width": 24,
        "height": 40, "num_frames": 1, "duration_seconds": None, "filename": "photo.jpg",
        "purpose": "vision", "status": "processed"}
    assert photo["bytes"] == len(jpeg(40, 24, orientation=6))
    assert photo["expires_at"] == photo["created_at"] + 30 * 86400  # retention_days
    clip = upload(api, "alice", "clip", video(frames=9, fps=8), purpose="video").json()
    assert (clip["kind"], clip["content_type"], clip["num_frames"],
            clip["duration_seconds"]) == ("video", "video/mp4", 9, 1.125)
    assert stored(api) == sorted([f"inputs/{photo['id']}.jpg", f"inputs/{clip['id']}.mp4"])
    assert (api.store.root / f"inputs/{photo['id']}.jpg").read_bytes() == jpeg(
        40, 24, orientation=6)

    assert api.client.get(f"/v1/files/{photo['id']}", headers=api.auth("alice")).json() == photo
    listed = api.client.get("/v1/files", headers=api.auth("alice")).json()
    assert [f["id"] for f in listed["data"]] == [clip["id"], photo["id"]]
    page = api.client.get("/v1/files?limit=1", headers=api.auth("alice")).json()
    assert [f["id"] for f in page["data"]] == [clip["id"]] and page["has_more"] is True
    rest = api.client.get(f"/v1/files?limit=1&after={clip['id']}",
                          headers=api.auth("alice")).json()
    assert [f["id"] for f in rest["data"]] == [photo["id"]] and rest["has_more"] is False
    assert api.client.get("/v1/files", headers=api.auth("bob")).json()["data"] == []

    # Another user's id is a 404 everywhere, as if it did not exist.
    for method, path in (("GET", f"/v1/files/{photo['id']}"),
                         ("DELETE", f"/v1/files/{photo['id']}"),
                         ("GET", f"/v1/files?after={photo['id']}")):
        r = api.client.request(method, path, headers=api.auth("bob"))
        assert r.status_code == 404 and r.json()["detail"] in (
            "file not found", "after: no such file"), (method, path)

    r = api.client.delete(f"/v1/files/{photo['id']}", headers=api.auth("alice"))
    assert r.json() == {"id": photo["id"], "object": "file", "deleted": True}
    assert api.client.get(f"/v1/files/{photo['id']}", headers=api.auth("alice")).status_code \
        == 404
    assert stored(api) == [f"inputs/{clip['id']}.mp4"] and rows(api) == (1, 0)
    assert redis_keys(api) == []


# (name, who, file name, bytes, content type, form fields, status, words of the reason)
HOSTILE: list[tuple[str, str, str, bytes, str, dict[str, str], int, str]] = [
    ("a 30,000x30,000 PNG", "alice", "big.png", png_declaring(30_000, 30_000), "image/png", {},
     422, "file: the image declares more than the 48,000,000 pixels allowed"),
    ("a truncated JPEG", "alice", "cut.jpg", jpeg(400, 300)[:600], "image/jpeg", {}, 422,
     "file: the image does not decode"),
    ("a PNG named .mp4", "alice", "clip.mp4", png(), "video/mp4", {}, 415,
     "file: the file's 'clip.mp4' says video, but its content is a PNG image"),
    ("a text file named .png", "alice", "cat.png", b"not an image at all\n" * 8, "image/png",
     {}, 415, "file: the content is not a PNG, JPEG or WebP image or an MP4 or WebM video"),
    ("an MP4 declaring 100,000 frames", "alice", "long.mp4", mp4_of_repeated_frames(100_000),
     "video/mp4", {}, 422, "file: the video declares 100,000 frames; at most 900 are allowed"),
    ("a 0-byte upload", "alice", "empty.png", b"", "image/png", {}, 422, "file: the file is empty"),
    ("an image where a video was asked for", "alice", "a.webp", webp(), "image/webp",
     {"purpose": "video"}, 422, "file: purpose 'video' takes video files; this is a "
                                "image/webp image"),
    ("an unknown purpose", "alice", "a.png", png(), "image/png", {"purpose": "fine-tune"}, 422,
     "purpose: must be one of image, vision, video, user_data"),
    ("an unknown field", "alice", "a.png", png(), "image/png", {"colour": "red"}, 422,
     "colour: unknown field"),
]


def test_hostile_uploads_get_a_4xx_naming_the_problem_and_leave_nothing_behind(
        files_api) -> None:  # noqa: ANN001
    api = files_api
    failures = []
    for name, who, filename, data, content_type, fields, status, reason in HOSTILE:
        r = upload(api, who, filename, data, content_type, **fields)
        body = r.json()
        if r.status_code != status or body.get("detail") != reason and not (
                body.get("detail", "").startswith(reason)):
            failures.append((name, r.status_code, body.get("detail")))
        elif body["error"]["param"] != reason.split(":")[0]:
            failures.append((name, "param", body["error"]))
    assert failures == []
    assert rows(api) == (0, 0) and redis_keys(api) == [] and stored(api) == []


def test_an_upload_over_the_limit_is_a_413_whether_or_not_its_length_is_declared(
        files_api) -> None:  # noqa: ANN001
    api = files_api
    over = b"\x89PNG\r\n\x1a\n" + b"\0" * UPLOAD_LIMIT
    r = upload(api, "alice", "big.png", over, "image/png")
    assert r.status_code == 413
    assert r.json()["detail"] == (f"file: the file is {len(over):,} bytes; at most "
                                  f"{UPLOAD_LIMIT:,} are allowed")

    def streamed() -> Iterator[bytes]:  # no Content-Length: cut off as it arrives
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n\r\n"
        for _ in range(2 * UPLOAD_LIMIT // 65536):
            yield b"\0" * 65536
        yield b"\r\n--b--\r\n"

    r = api.client.post("/v1/files", content=streamed(),
                        headers={**api.auth("alice"),
                                 "Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413 and "larger than" in r.json()["detail"]
    r = api.client.post("/v1/files", content=b"x" * (2 * UPLOAD_LIMIT),
                        headers={**api.auth("alice"),
                                 "Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413  # refused from Content-Length, unread
    assert rows(api) == (0, 0) and redis_keys(api) == [] and stored(api) == []


def test_uploads_need_a_key_and_a_multipart_file(files_api) -> None:  # noqa: ANN001
    api = files_api
    assert api.client.post("/v1/files", files={"file": ("a.png", png())}).status_code == 401
    assert api.client.get("/v1/files").status_code == 401
    r = api.client.post("/v1/files", headers=api.auth("alice"), json={"file": "x"})
    assert r.status_code == 415
    r = api.client.post("/v1/files", headers=api.auth("alice"), data={"purpose": "vision"},
                        files={"other": ("a.txt", b"x")})
    assert r.status_code == 422


def test_video_input_reference_is_checked_then_refused_by_a_model_without_inputs(
        files_api) -> None:  # noqa: ANN001
    api = files_api
    mine = upload(api, "alice", "a.mp4", video()).json()["id"]
    bobs = upload(api, "bob", "b.png", png()).json()["id"]
    before = rows(api), stored(api)
    cases = [
        # A good file reaches the model's answer: kiln-big takes no input; kiln-tiny does.
        ({"files": {"input_reference": ("start.mp4", video(), "video/mp4")},
          "data": {"model": "kiln-big"}}, 400,
         "input_reference: model 'kiln-big' cannot take a video input; models that take one: "
         "kiln-tiny"),
        ({"data": {"input_reference[file_id]": mine, "model": "kiln-big"}}, 400,
         "input_reference: model 'kiln-big' cannot take a video input"),
        ({"json": {"prompt": "p", "model": "kiln-big", "input_reference": {"file_id": mine}}},
         400, "input_reference: model 'kiln-big' cannot take a video input"),
        # A bad one gets its own refusal first.
        ({"files": {"input_reference": ("big.png", png_declaring(30_000, 30_000))}}, 422,
         "input_reference: the image declares more than"),
        ({"files": {"input_reference": ("cut.jpg", jpeg(400, 300)[:600])}}, 422,
         "input_reference: the image does not decode"),
        ({"files": {"input_reference": ("x.mp4", png())}}, 415,
         "input_reference: the file's 'x.mp4' says video"),
        ({"files": {"input_reference": ("e.png", b"")}}, 422, "input_reference: the file is "
                                                              "empty"),
        ({"data": {"input_reference[file_id]": bobs}}, 404, "input_reference: file not found"),
        ({"json": {"prompt": "p", "input_reference": {"image_url": "http://x/a.png"}}}, 400,
         "input_reference: give a file, or"),
        ({"files": {"input_reference": ("a.png", png()), }, "data": {"size": "abc"}}, 422,
         "size:"),
    ]
    for kwargs, status, reason in cases:
        kwargs = dict(kwargs)
        if "json" not in kwargs:
            kwargs["data"] = {"prompt": "p", **kwargs.get("data", {})}
        r = api.client.post("/v1/videos", headers=api.auth("alice"), **kwargs)
        assert (r.status_code, r.json()["detail"][:len(reason)]) == (status, reason), r.text
        if status == 400:
            assert r.json()["error"] == {"message": r.json()["detail"], "param":
                                         "input_reference", "code": "unsupported_parameter",
                                         "type": "invalid_request_error"}
    assert (rows(api), stored(api)) == before and redis_keys(api) == []
    # Without a reference the route is as it was.
    r = api.client.post("/v1/videos", headers=api.auth("alice"), data={"prompt": "p"})
    assert r.status_code == 200 and rows(api)[1] == 1
    # kiln-tiny takes an image (its first frame) and a clip (video-to-video).
    r = api.client.post("/v1/videos", headers=api.auth("alice"), data={"prompt": "p"},
                        files={"input_reference": ("start.png", png(), "image/png")})
    assert r.status_code == 200 and rows(api) == (before[0][0] + 1, 2), r.text
    r = api.client.post("/v1/videos", headers=api.auth("alice"),
                        data={"prompt": "p", "input_reference[file_id]": mine})
    assert r.status_code == 200 and rows(api) == (before[0][0] + 1, 3), r.text


def test_json_bodies_of_videos_keep_the_json_limit(files_api) -> None:  # noqa: ANN001
    api = files_api
    r = api.client.post("/v1/videos", headers=api.auth("alice"),
                        json={"prompt": "x" * (api.settings.max_body_bytes + 10)})
    assert r.status_code == 413 and "larger than" in r.json()["detail"]


def test_the_openai_sdk_uploads_and_references_files(files_api, tmp_path: Path) -> None:  # noqa: ANN001
    api = files_api
    start = tmp_path / "start.mp4"
    start.write_bytes(video())
    with Server(api.app, lifespan="off", ws="none", http="h11") as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=api.keys["alice"], max_retries=0,
                            timeout=10)
        with start.open("rb") as f:
            uploaded = sdk.files.create(file=f, purpose="user_data")
        assert (uploaded.id, uploaded.bytes, uploaded.filename) == (
            uploaded.id, start.stat().st_size, "start.mp4")
        assert sdk.files.retrieve(uploaded.id).id == uploaded.id
        assert [f.id for f in sdk.files.list()] == [uploaded.id]
        # This SDK takes only a file as input_reference; a file id goes in extra_body, which it
        # sends as the form field input_reference[file_id].
        for given in ({"input_reference": start.read_bytes()},
                      {"extra_body": {"input_reference": {"file_id": uploaded.id}}}):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.videos.create(prompt="p", model="kiln-big", **given)  # type: ignore[arg-type]
            assert refused.value.param == "input_reference"
            assert "cannot take a video input" in refused.value.message
        with pytest.raises(openai.UnprocessableEntityError, match="does not decode"):
            sdk.videos.create(prompt="p", input_reference=("cut.jpg", jpeg(400, 300)[:600]))
        assert sdk.files.delete(uploaded.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(uploaded.id)
    assert rows(api) == (0, 0) and stored(api) == []
