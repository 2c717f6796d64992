"""The unchanged OpenAI SDK against `kiln up` on its defaults (kiln-tiny, dp=2): a video from a
picture (``create(input_reference=open("start.png", "rb"))``), then a remix and an edit of it
(video-to-video) and an extension (image-to-video from its last frame, stored after it), each
completed and downloaded as an MP4 of the asked length. The picture is the first frame; the
extension's first new frame continues the source's last."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from servers import decoded, kiln_up

# The SDK marks its videos API deprecated (OpenAI's hosted service); kiln serves it.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Sora API is scheduled:DeprecationWarning")


def _done(sdk: openai.OpenAI, video: openai.types.Video, out: Path) -> np.ndarray:
    deadline = time.monotonic() + 240  # the group loads the model meanwhile
    while video.status not in ("completed", "failed"):
        assert time.monotonic() < deadline, video
        time.sleep(0.2)
        video = sdk.videos.retrieve(video.id)
    assert video.status == "completed", video.error
    sdk.videos.download_content(video.id).write_to_file(out)
    return decoded(out)


def _red_centre(frame: np.ndarray) -> tuple[float, float]:
    f = frame.astype(np.int32)
    ys, xs = np.nonzero((f[..., 0] > 150) & (f[..., 1] < 110) & (f[..., 2] < 110))
    assert len(xs), "no red shape in the frame"
    return float(xs.mean()), float(ys.mean())


@pytest.mark.slow
@pytest.mark.chaos  # a kiln up: `make chaos` runs it, `make test` does not
def test_the_openai_sdk_creates_remixes_edits_and_extends_against_kiln_up(
        tmp_path: Path) -> None:
    pixels = np.full((64, 64, 3), 80, np.uint8)
    pixels[24:40, 36:52] = (220, 40, 40)  # a red square right of centre, on grey
    start = tmp_path / "start.png"
    Image.fromarray(pixels).save(start)
    with kiln_up(tmp_path, "--dp", "2") as (base, key):
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        with start.open("rb") as f:
            first = sdk.videos.create(prompt="a red square moving left", input_reference=f,
                                      seconds="1")
        frames = _done(sdk, first, tmp_path / "first.mp4")
        assert frames.shape == (9, 64, 64, 3)  # 1 s at 8 fps: 1 + 8 frames
        x, y = _red_centre(frames[0])
        assert abs(x - 43.5) < 3 and abs(y - 31.5) < 3  # the picture is the first frame
        assert _red_centre(frames[-1])[0] < x - 4  # and the square moves left

        remix = sdk.videos.remix(first.id, prompt="a red square moving right")
        assert remix.remixed_from_video_id == first.id
        assert _done(sdk, remix, tmp_path / "remix.mp4").shape == frames.shape

        with (tmp_path / "first.mp4").open("rb") as f:
            edit = sdk.videos.edit(video=f, prompt="a red square moving down")
        assert _done(sdk, edit, tmp_path / "edit.mp4").shape == frames.shape

        # This SDK sends only a file as `video` (a {"id": ...} reference trips its own file
        # check), so the extension continues the downloaded MP4.
        with (tmp_path / "first.mp4").open("rb") as f:
            # Back the way it came: kiln-tiny learnt shapes that stay in the picture.
            extension = sdk.videos.extend(video=f, prompt="a red square moving right",
                                          seconds=1)  # type: ignore[arg-type]
        longer = _done(sdk, extension, tmp_path / "extend.mp4")
        # The source's 9 frames, then 1 s more (the new part's first frame is the source's
        # last, written once).
        assert longer.shape == (9 + 8, 64, 64, 3)
        # Re-encoded, so close rather than equal: the source's frames come first.
        assert np.abs(longer[:9].astype(int) - frames.astype(int)).mean() < 6
        # The first new frame continues from where the source ended.
        assert np.hypot(*np.subtract(_red_centre(longer[9]), _red_centre(frames[-1]))) < 6
