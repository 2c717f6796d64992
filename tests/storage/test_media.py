"""Input media: every accepted format decodes to what it is; every hostile file is refused with a
code and a reason before anything keeps it; `fit` brings an image to a size by its stated rule."""

from __future__ import annotations

import io
import time

import av
import numpy as np
import pytest
from media_files import (
    jpeg,
    mp4_of_repeated_frames,
    mp4_with_a_gap,
    png,
    png_declaring,
    video,
    webp,
)
from PIL import Image

from storage import media

LIMITS = media.Limits(max_pixels=4096 * 4096, max_frames=30, max_seconds=10.0)


def check(data: bytes, limits: media.Limits = LIMITS, **claims: str) -> media.Media:
    return media.check(io.BytesIO(data), limits, **claims)


@pytest.mark.parametrize(("data", "kind", "content_type", "extension", "size", "frames"), [
    (png(), "image", "image/png", "png", (40, 24), 1),
    (jpeg(), "image", "image/jpeg", "jpg", (40, 24), 1),
    (webp(), "image", "image/webp", "webp", (40, 24), 1),
    (video(), "video", "video/mp4", "mp4", (16, 16), 9),
    (video("libvpx-vp9", "webm", frames=5), "video", "video/webm", "webm", (16, 16), 5),
])
def test_each_accepted_format_is_known_by_its_content(data: bytes, kind: str, content_type: str,
                                                      extension: str, size: tuple[int, int],
                                                      frames: int) -> None:
    # The client's name says nothing the content does not decide: none, or a wrong format of
    # the same kind, is fine.
    for filename in (None, "upload.bin", f"x.{'png' if kind == 'image' else 'webm'}"):
        found = check(data, filename=filename)
        assert (found.kind, found.content_type, found.extension) == (kind, content_type,
                                                                     extension)
        assert ((found.width, found.height), found.num_frames) == (size, frames)
    assert (found.duration_seconds is None) == (kind == "image")


def test_a_video_s_duration_is_its_frames_at_its_rate() -> None:
    assert check(video(frames=9, fps=8)).duration_seconds == pytest.approx(9 / 8)


def test_exif_orientation_is_applied() -> None:
    found = check(jpeg(40, 24, orientation=6))
    assert (found.width, found.height) == (24, 40)
    image = media.open_image(io.BytesIO(jpeg(40, 24, orientation=6)), LIMITS)
    assert image.size == (24, 40) and image.mode == "RGB"
    # The white mark at the file's top left is shown at the top right after a quarter turn.
    pixels = np.asarray(image).astype(int)
    assert pixels[2, 21].min() > 200 and pixels[2, 2].min() < 100


@pytest.mark.parametrize(("data", "claims", "code", "needle"), [
    (b"", {}, "empty_file", "the file is empty"),
    (b"hello, this is text\n" * 4, {"filename": "cat.png"}, "unsupported_type",
     "not a PNG, JPEG or WebP image or an MP4 or WebM video"),
    (png(), {"filename": "clip.mp4"}, "unsupported_type",
     "'clip.mp4' says video, but its content is a PNG image"),
    (video(), {"filename": "x", "content_type": "image/png"}, "unsupported_type",
     "content type 'image/png' says image, but its content is a MP4 video"),
    (png_declaring(30_000, 30_000), {}, "too_many_pixels", "pixels allowed"),
    (png_declaring(5000, 5000), {}, "too_many_pixels",
     "the image is 5000x5000, 25,000,000 pixels; at most 16,777,216 are allowed"),
    (png_declaring(64, 64), {}, "undecodable", "the image does not decode"),
    (jpeg(400, 300)[:600], {}, "undecodable", "the image does not decode"),
    (video()[:300], {}, "undecodable", "the video does not open"),
    (mp4_of_repeated_frames(100_000), {}, "too_many_frames",
     "the video declares 100,000 frames; at most 30 are allowed"),
    (video("libvpx-vp9", "webm", frames=40), {}, "too_many_frames",
     "the video holds more than 30 frames"),
    (mp4_with_a_gap(100), {}, "too_long", "at most 10 s are allowed"),
    (video("mpeg4", "mp4"), {}, "unsupported_type", "the video is mpeg4"),
])
def test_hostile_files_are_refused_naming_the_problem(data: bytes, claims: dict[str, str],
                                                      code: str, needle: str) -> None:
    with pytest.raises(media.Rejected) as refused:
        check(data, **claims)
    assert refused.value.code == code
    assert needle in str(refused.value)


def test_a_bomb_is_refused_from_its_header_without_decoding() -> None:
    start = time.perf_counter()
    with pytest.raises(media.Rejected, match="pixels"):
        check(png_declaring(30_000, 30_000), media.Limits(10**6, 30, 10.0))
    assert time.perf_counter() - start < 0.5  # 2.7 GB of pixels were never decoded


def test_frames_past_the_bound_are_caught_while_decoding_when_the_header_says_nothing() -> None:
    data = video("libvpx-vp9", "webm", frames=40)
    with av.open(io.BytesIO(data)) as container:  # WebM declares no frame count
        assert container.streams.video[0].frames == 0
    assert check(data, media.Limits(4096, 40, 10.0)).num_frames == 40


def _marked(width: int, height: int) -> Image.Image:
    """A grey image with a red band, a tenth of its width, at its left edge and a blue one at
    its right."""
    band = width // 10
    pixels = np.full((height, width, 3), 128, np.uint8)
    pixels[:, :band] = (255, 0, 0)
    pixels[:, -band:] = (0, 0, 255)
    return Image.fromarray(pixels)


def test_fit_crop_covers_the_size_and_cuts_the_middle_out() -> None:
    wide = _marked(200, 100)
    out = media.fit(wide, 64, 64)  # crop is the default
    assert out.size == (64, 64)
    pixels = np.asarray(out).astype(int)
    # Scaled to 128x64, the middle 64 columns kept: both bands (13 columns each) fall outside.
    assert abs(pixels[:, 0] - 128).max() < 8 and abs(pixels[:, -1] - 128).max() < 8


def test_fit_pad_fits_inside_and_centres_on_black() -> None:
    out = media.fit(_marked(200, 100), 64, 64, "pad")
    assert out.size == (64, 64)
    pixels = np.asarray(out).astype(int)
    # Scaled to 64x32, centred: 16 black rows above and below, the marks at the edges.
    assert pixels[:15].max() == 0 and pixels[-15:].max() == 0
    assert pixels[32, 1, 0] > 200 and pixels[32, -2, 2] > 200


def test_fit_stretch_keeps_everything_and_drops_the_aspect() -> None:
    out = media.fit(_marked(200, 100), 64, 64, "stretch")
    assert out.size == (64, 64)
    pixels = np.asarray(out).astype(int)
    assert pixels[:, 1, 0].min() > 200 and pixels[:, -2, 2].min() > 200
    assert (pixels[:, 32] == pixels[0, 32]).all()  # every row alike: nothing cut, no padding


@pytest.mark.parametrize("mode", media.FIT_MODES)
@pytest.mark.parametrize(("source", "target"), [((37, 91), (64, 48)), ((1, 1), (16, 32)),
                                                ((640, 480), (832, 480)), ((64, 48), (64, 48))])
def test_fit_gives_exactly_the_size_asked_for(mode: media.FitMode, source: tuple[int, int],
                                              target: tuple[int, int]) -> None:
    assert media.fit(Image.new("RGB", source, (9, 9, 9)), *target, mode).size == target


def test_fit_refuses_an_unknown_mode_and_an_empty_size() -> None:
    with pytest.raises(ValueError, match="mode must be one of crop, pad, stretch"):
        media.fit(Image.new("RGB", (4, 4)), 8, 8, "zoom")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size must be positive"):
        media.fit(Image.new("RGB", (4, 4)), 0, 8)
