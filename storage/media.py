"""Input media: images and videos decoded and checked under bounds before anything keeps them,
and the rule (`fit`) that brings an image to a job's size.

What a file is comes from its content: its first bytes choose the decoder (PNG, JPEG, WebP,
MP4, WebM) and the decoder must accept it. A file name or a client's content type decides
nothing; one that names the other kind (a PNG called ``.mp4``) is refused as a contradiction.
An image's pixel count is checked from its header before a pixel is decoded (decompression
bombs), then the whole image is decoded (a truncated file fails here, not on a rank). A video's
frame count and duration are checked from its container's header, then again while every frame
is decoded, because a header can say less than the file holds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import BinaryIO, Literal, cast

import av
from PIL import Image, ImageOps, UnidentifiedImageError

from common.settings import Settings

Kind = Literal["image", "video"]
FitMode = Literal["crop", "pad", "stretch"]
FIT_MODES: tuple[FitMode, ...] = ("crop", "pad", "stretch")

# Format -> (kind, content type, the store key's extension, Pillow's format name or None).
_FORMATS: dict[str, tuple[Kind, str, str, str | None]] = {
    "png": ("image", "image/png", "png", "PNG"),
    "jpeg": ("image", "image/jpeg", "jpg", "JPEG"),
    "webp": ("image", "image/webp", "webp", "WEBP"),
    "mp4": ("video", "video/mp4", "mp4", None),
    "webm": ("video", "video/webm", "webm", None),
}
# The video codecs accepted, by FFmpeg's decoder name.
VIDEO_CODECS = frozenset({"h264", "vp8", "vp9", "av1", "libdav1d"})
_EXTENSIONS: dict[str, Kind] = {
    ".png": "image", ".jpg": "image", ".jpeg": "image", ".webp": "image", ".gif": "image",
    ".bmp": "image", ".tif": "image", ".tiff": "image", ".heic": "image", ".avif": "image",
    ".mp4": "video", ".m4v": "video", ".mov": "video", ".webm": "video", ".mkv": "video",
    ".avi": "video",
}
_SUPPORTED = "a PNG, JPEG or WebP image or an MP4 or WebM video"


class Rejected(ValueError):
    """An input that is refused, with a stable ``code`` and a message naming the problem.

    Codes: ``empty_file``, ``unsupported_type`` (the content is no accepted format, or contradicts
    the name it came with), ``too_many_pixels``, ``too_many_frames``, ``too_long``,
    ``undecodable``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Limits:
    max_pixels: int  # of an image or of one video frame
    max_frames: int
    max_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.max_input_pixels, settings.max_input_frames,
                   settings.max_input_seconds)


@dataclass(frozen=True, slots=True)
class Media:
    """What a checked input is: its kind and format, and its size after EXIF orientation."""

    kind: Kind
    content_type: str
    extension: str  # of its store key; from the content, never from the client
    width: int
    height: int
    num_frames: int  # 1 for an image; the frames decoded for a video
    duration_seconds: float | None  # None for an image


def sniff(head: bytes) -> str | None:
    """The format the first bytes announce (a key of the formats above), or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3") and b"webm" in head[:64]:  # EBML, DocType webm
        return "webm"
    return None


def claimed_kind(filename: str | None, content_type: str | None) -> Kind | None:
    """The kind a file's name or content type claims (``image``, ``video``), or None when it
    claims neither (no name, ``application/octet-stream``)."""
    kind = _EXTENSIONS.get(PurePosixPath(filename or "").suffix.lower())
    if kind is not None:
        return kind
    major = (content_type or "").split("/")[0].strip().lower()
    return cast(Kind, major) if major in ("image", "video") else None


def check(file: BinaryIO, limits: Limits, *, filename: str | None = None,
          content_type: str | None = None) -> Media:
    """Decodes ``file`` whole under ``limits`` and says what it is; raises `Rejected` naming
    the problem. ``filename`` and ``content_type`` (the client's) are only held against the
    content: naming the other kind is refused."""
    file.seek(0)
    head = file.read(64)
    file.seek(0)
    if not head:
        raise Rejected("empty_file", "the file is empty")
    fmt = sniff(head)
    if fmt is None:
        raise Rejected("unsupported_type", f"the content is not {_SUPPORTED}")
    kind, mime, extension, pillow_format = _FORMATS[fmt]
    claimed = claimed_kind(filename, content_type)
    if claimed is not None and claimed != kind:
        said = repr(filename) if _EXTENSIONS.get(PurePosixPath(filename or "").suffix.lower()) \
            else f"content type {content_type!r}"
        raise Rejected("unsupported_type",
                       f"the file's {said} says {claimed}, but its content is a {fmt.upper()} "
                       f"{kind}")
    if pillow_format is not None:
        image = open_image(file, limits, formats=(pillow_format,))
        return Media(kind, mime, extension, image.width, image.height, 1, None)
    frames, width, height, seconds = _decode_video(file, limits)
    return Media(kind, mime, extension, width, height, frames, seconds)


def open_image(file: BinaryIO, limits: Limits,
               formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")) -> Image.Image:
    """The image in ``file``, decoded under ``limits`` with its EXIF orientation applied, in RGB.

    An animated PNG or WebP gives its first frame."""
    file.seek(0)
    with warnings.catch_warnings():
        # Pillow's own bomb bound warns from inside `open`; it is a refusal here, not a warning.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(file, formats=list(formats))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise Rejected("too_many_pixels", f"the image declares more than the "
                                              f"{limits.max_pixels:,} pixels allowed") from exc
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise Rejected("undecodable", f"the image does not decode: {exc}") from exc
    _check_pixels(*image.size, limits, declares="the image declares a size of",
                  measures="the image is")
    try:
        image.load()  # Pillow refuses a truncated file here (LOAD_TRUNCATED_IMAGES is off)
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise Rejected("undecodable", f"the image does not decode: {exc}") from exc


def _decode_video(file: BinaryIO, limits: Limits) -> tuple[int, int, int, float]:
    """(frames, width, height, seconds) of the video in ``file``, every frame decoded."""
    try:
        container = av.open(file, mode="r")
    except (av.FFmpegError, ValueError) as exc:
        raise Rejected("undecodable", f"the video does not open: {exc}") from exc
    with container:
        if not container.streams.video:
            raise Rejected("undecodable", "the file holds no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in VIDEO_CODECS:
            raise Rejected("unsupported_type", f"the video is {codec}; accepted: H.264, VP8, "
                                               f"VP9, AV1")
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, limits)
        if stream.frames > limits.max_frames:
            raise Rejected("too_many_frames", f"the video declares {stream.frames:,} frames; "
                                              f"at most {limits.max_frames:,} are allowed")
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > limits.max_seconds:
            raise Rejected("too_long", f"the video declares {declared:.1f} s; at most "
                                       f"{limits.max_seconds:g} s are allowed")
        frames, last = 0, 0.0
        try:
            for frame in container.decode(stream):
                frames += 1
                if frames > limits.max_frames:
                    raise Rejected("too_many_frames", f"the video holds more than "
                                                      f"{limits.max_frames:,} frames, the most "
                                                      f"allowed")
                _check_pixels(frame.width, frame.height, limits)
                if frame.time is not None:
                    last = max(last, frame.time)
                    if last > limits.max_seconds:
                        raise Rejected("too_long", f"the video runs past {limits.max_seconds:g} "
                                                   f"s, the longest allowed")
        except av.FFmpegError as exc:
            raise Rejected("undecodable", f"the video does not decode after {frames} frames: "
                                          f"{exc}") from exc
        if frames == 0:
            raise Rejected("undecodable", "no frame of the video decodes")
        rate = stream.average_rate or stream.guessed_rate
        seconds = last + (1 / float(rate) if rate else 0.0)
        return frames, width, height, round(seconds, 3)


def _check_pixels(width: int, height: int, limits: Limits, *,
                  declares: str = "the video declares a frame size of",
                  measures: str = "the video's frames are") -> None:
    """An image's size, or a video's frame size, within ``limits`` (the messages name which)."""
    if width < 1 or height < 1:
        raise Rejected("undecodable", f"{declares} {width}x{height}")
    if width * height > limits.max_pixels:
        raise Rejected("too_many_pixels", f"{measures} {width}x{height}, "
                                          f"{width * height:,} pixels; at most "
                                          f"{limits.max_pixels:,} are allowed")


def _declared_seconds(container: av.container.InputContainer,
                      stream: av.VideoStream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def fit(image: Image.Image, width: int, height: int, mode: FitMode = "crop") -> Image.Image:
    """``image`` at exactly ``width`` x ``height``, by the job's rule:

    - ``crop`` (the default): scaled, keeping its aspect, until it covers the size, then the
      middle cut out (what falls outside is lost);
    - ``pad``: scaled, keeping its aspect, until it fits inside, then centred on black;
    - ``stretch``: scaled to the size, its aspect ignored.

    Resampled with Lanczos, as diffusers' image processors do."""
    if width < 1 or height < 1:
        raise ValueError(f"fit: the size must be positive, got {width}x{height}")
    size = (width, height)
    method = Image.Resampling.LANCZOS
    if mode == "crop":
        return ImageOps.fit(image, size, method=method, centering=(0.5, 0.5))
    if mode == "pad":
        return ImageOps.pad(image, size, method=method, color=(0,) * len(image.getbands()),
                            centering=(0.5, 0.5))
    if mode == "stretch":
        return image.resize(size, method)
    raise ValueError(f"fit: mode must be one of {', '.join(FIT_MODES)}, got {mode!r}")


def fitted_frames(file: BinaryIO, kind: str, limits: Limits, width: int, height: int,
                  mode: FitMode = "crop", *, max_frames: int | None = None) -> list[Image.Image]:
    """The frames a render starts from: an image (one frame) or a video's first ``max_frames``
    frames, decoded under ``limits`` again (the file was checked at upload; this keeps a
    replaced object from reaching a rank), each fitted to ``width`` x ``height`` by `fit` in
    ``mode``. RGB images; `Rejected` for a file that no longer decodes."""
    if kind == "image":
        return [fit(open_image(file, limits), width, height, mode)]
    file.seek(0)
    out: list[Image.Image] = []
    try:
        with av.open(file, mode="r") as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                _check_pixels(frame.width, frame.height, limits)
                out.append(fit(frame.to_image().convert("RGB"), width, height, mode))
                if len(out) >= (max_frames or limits.max_frames):
                    break
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise Rejected("undecodable", f"the video does not decode: {exc}") from exc
    if not out:
        raise Rejected("undecodable", "no frame of the video decodes")
    return out
