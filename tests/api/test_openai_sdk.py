"""The official ``openai`` SDK, unchanged, against kiln over real HTTP (uvicorn in a thread).

Jobs stay queued here because no worker group runs in these tests; the download test finishes a
job through the repository's guarded transitions with files written by LocalStore: it checks the
storage and download path, not a render.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from servers import Server

pytestmark = pytest.mark.filterwarnings(
    # The SDK marks its video methods deprecated for OpenAI's own service; kiln is unaffected.
    "ignore:The Sora API is scheduled:DeprecationWarning"
)


@pytest.fixture
def base_url(api) -> Iterator[str]:  # noqa: ANN001
    # The app's lifespan already ran under the TestClient in the `api` fixture.
    with Server(api.app, lifespan="off", ws="none", http="h11") as url:
        yield f"{url}/v1"


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=10)


def test_sdk_create_retrieve_and_list_a_queued_video(api, base_url: str) -> None:  # noqa: ANN001
    sdk = client(base_url, api.keys["alice"])
    video = sdk.videos.create(prompt="a red circle moving left", model="kiln-tiny",
                              size="64x64", seconds="1")  # type: ignore[arg-type]
    assert isinstance(video, openai.types.Video)
    assert (video.object, video.status, video.progress) == ("video", "queued", 0)
    assert (video.model, video.size, video.seconds) == ("kiln-tiny", "64x64", "1")
    assert video.prompt == "a red circle moving left" and video.error is None
    assert abs(video.created_at - time.time()) < 60

    again = sdk.videos.retrieve(video.id)
    assert (again.id, again.status) == (video.id, "queued")
    native = api.client.get(f"/v1/jobs/{video.id}", headers=api.auth("alice")).json()
    # 1 s at 8 fps is 1 + 8 frames (the VAE's frame stride of 4 after the first frame).
    assert (native["width"], native["num_frames"], native["fps"]) == (64, 9, 8)

    default = sdk.videos.create(prompt="no options")  # the SDK's own default model name
    assert default.model == "kiln-tiny"
    assert default.size == "64x64"  # kiln-tiny's own size
    page = sdk.videos.list(limit=1)
    assert [v.id for v in page.data] == [default.id] and page.has_more
    assert [v.id for v in sdk.videos.list(limit=1, after=default.id).data] == [video.id]


def test_sdk_download_content_after_storage_finish_not_a_render(api, base_url: str) -> None:  # noqa: ANN001
    sdk = client(base_url, api.keys["alice"])
    video = sdk.videos.create(prompt="p", model="kiln-tiny", size="64x64")  # type: ignore[arg-type]
    api.finish(video.id, video=b"fake mp4 bytes", thumb=b"fake png bytes")
    done = sdk.videos.retrieve(video.id)
    assert (done.status, done.progress) == ("completed", 100) and done.completed_at is not None
    assert sdk.videos.download_content(video.id).content == b"fake mp4 bytes"
    assert sdk.videos.download_content(video.id, variant="thumbnail").content == (
        b"fake png bytes")
    deleted = sdk.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(video.id)


def test_sdk_sees_kiln_errors_as_its_own_exception_types(api, base_url: str) -> None:  # noqa: ANN001
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "not-a-key").videos.retrieve("abc")
    sdk = client(base_url, api.keys["alice"])
    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk.videos.create(prompt="p", size="99999x1")  # type: ignore[arg-type]
    assert "size" in str(err.value)
    other = client(base_url, api.keys["bob"]).videos.create(prompt="bob's")
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(other.id)
    failed_id = sdk.videos.create(prompt="will be cancelled").id
    api.client.post(f"/v1/jobs/{failed_id}/cancel", headers=api.auth("alice"))
    failed = sdk.videos.retrieve(failed_id)
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "cancelled"
