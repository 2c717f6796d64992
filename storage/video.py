"""Video outputs: H.264 MP4 through PyAV (no system ffmpeg), with an AAC soundtrack when the model
made one, and a PNG thumbnail through Pillow.

Both are written atomically: into a temporary file in the destination's directory, then
``os.replace``d over the final name, so a reader never sees a half-written file and a crash leaves
at most a hidden ``.*.tmp`` file behind. `OutputWriter` encodes a finished job's files and puts
them into an output store, keeping them while the store fails, and stores a running job's
preview frames.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import tempfile
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple, cast

import av
import numpy as np
from PIL import Image, PngImagePlugin

from common.files import atomic_path
from storage.outputs import (
    PREVIEW_STEP_KEYWORD,
    OutputStore,
    OutputStoreError,
    preview_key,
    thumbnail_key,
    video_key,
)

DEFAULT_FPS = 16  # Wan's frame rate
# The soundtrack's AAC bit rate (one or two channels), FFmpeg's default. Its native encoder at
# 192 kb/s and above puts a click (0.43 off on a 0.5 tone) into a sound that starts with the
# first sample, as a model's does; at 128 kb/s that first frame is 0.07 off at most.
AAC_BIT_RATE = 128_000
_AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}


class Soundtrack(NamedTuple):
    """A video's sound: float samples in [-1, 1], ``[channels, samples]`` (numpy or a torch
    tensor; one or two channels), played from the video's first frame at ``sample_rate`` Hz.
    A pipeline's ``decode_audio`` returns this pair as a plain tuple."""

    samples: Any
    sample_rate: int


def float_to_uint8(x: Any) -> Any:
    """Float values in [0, 1] -> uint8 0-255, as the same kind of array: numpy stays numpy, a
    torch tensor stays a tensor on its device (through ``.byte()``: this module loads no torch).

    Clipped, scaled by 255 and rounded half to even: diffusers' numpy_to_pil, so frames match
    its PIL output.
    """
    scaled = (x.clip(0.0, 1.0) * 255).round()
    return scaled.astype(np.uint8) if isinstance(scaled, np.ndarray | np.generic) else scaled.byte()


def to_uint8(frames: object) -> np.ndarray:
    """[N, H, W, 3] frames, float in [0, 1] (numpy or torch) or uint8, -> uint8 numpy."""
    arr = frames.detach().cpu().numpy() if hasattr(frames, "detach") else np.asarray(frames)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"frames must be [N, H, W, 3], got shape {list(arr.shape)}")
    if arr.dtype == np.uint8:
        return arr
    return float_to_uint8(arr)


@functools.cache
def _x264_options() -> dict[str, str]:
    """Options that make x264 give the same file for the same frames in every process.

    On a CPU with AVX-512, x264's AVX-512 code (its MB-tree lookahead) made the same frames
    encode differently from one process to the next, one thread or many, so a job's video did
    not equal `kiln render`'s for the same seed. Held to AVX2 there, it encodes the same file
    every time (24 of 24 encodes; 9 different files in 24 without), at the same size. Turning
    MB-tree off also worked, but made files 9 % (kiln-tiny) to 59 % (an 832x480 clip) larger.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return {}
    if "avx512f" in flags and "avx2" in flags:
        return {"x264-params": "asm=AVX2"}
    return {}


def fit_audio(audio: Soundtrack, num_frames: int, fps: int) -> np.ndarray:
    """``audio``'s samples as float32 ``[channels, round(num_frames / fps * sample_rate)]``:
    cut, or padded with silence, to the video's duration.

    A model's soundtrack comes on its own grid (MiniMax-H3: whole latents of 1/40 s), which
    ends a few milliseconds before or after the last frame does; a request may also write the
    frames at another rate than the model's, which changes the video's length but not the
    sound's. The video's length is the one the request asked for, so the sound is fitted to
    it: the samples past the last frame are dropped (they have no picture) and a short sound
    is followed by silence, never stretched (that would change its pitch)."""
    samples = audio.samples
    arr = samples.detach().cpu().numpy() if hasattr(samples, "detach") else np.asarray(samples)
    if arr.ndim != 2 or arr.shape[0] not in _AUDIO_LAYOUTS:
        raise ValueError(f"audio samples must be [channels, samples] with 1 or 2 channels, got "
                         f"shape {list(arr.shape)}")
    if audio.sample_rate <= 0:
        raise ValueError(f"the sample rate must be positive, got {audio.sample_rate}")
    want = round(Fraction(num_frames, fps) * audio.sample_rate)
    arr = np.clip(arr[:, :want].astype(np.float32), -1.0, 1.0)
    if arr.shape[1] < want:
        arr = np.pad(arr, ((0, 0), (0, want - arr.shape[1])))
    return np.ascontiguousarray(arr)


def write_video(frames: object, path: str | os.PathLike[str], *, fps: int = DEFAULT_FPS,
                crf: int = 18, audio: Soundtrack | None = None) -> Path:
    """Encode [N, H, W, 3] frames as H.264 (yuv420p) in an MP4 at ``path``; returns the path.
    The index (``moov``) goes before the frames (``faststart``): a browser plays the video as it
    arrives instead of after the whole file.

    ``audio``: a second stream, AAC, starting with the first frame and as long as the video
    (`fit_audio`); each frame's stretch of sound is encoded right after the frame, so the two
    streams are interleaved in the file as they play. Without it the file is the video alone,
    byte for byte what it was before soundtracks existed."""
    rgb = to_uint8(frames)
    n, h, w, _ = rgb.shape
    if n == 0:
        raise ValueError("no frames to write")
    if h % 2 or w % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even width and height, got {w}x{h}")
    sound = None if audio is None else fit_audio(audio, n, fps)
    path = Path(path)
    with atomic_path(path) as tmp:
        with av.open(str(tmp), mode="w", format="mp4",
                     options={"movflags": "faststart"}) as container:
            stream = container.add_stream("libx264", rate=Fraction(fps))
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            stream.options = {"crf": str(crf), **_x264_options()}
            track = None
            if sound is not None:
                assert audio is not None
                track = container.add_stream("aac", rate=audio.sample_rate,
                                             layout=_AUDIO_LAYOUTS[sound.shape[0]])
                track.bit_rate = AAC_BIT_RATE
            for i, frame in enumerate(rgb):
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
                if track is not None:
                    assert audio is not None and sound is not None
                    # The samples that play during frame i (PyAV cuts them into AAC frames).
                    start, end = (round(Fraction(k, fps) * audio.sample_rate) for k in (i, i + 1))
                    _encode_audio(container, track, sound, start, end)
            for packet in stream.encode():  # flush the encoder's delayed frames
                container.mux(packet)
            if track is not None:
                for packet in track.encode():
                    container.mux(packet)
    return path


def _encode_audio(container: Any, track: Any, sound: np.ndarray, start: int, end: int) -> None:
    if end <= start:
        return
    chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(sound[:, start:end]), format="fltp",
                                       layout=track.layout.name)
    chunk.sample_rate, chunk.pts = track.rate, start
    for packet in track.encode(chunk):
        container.mux(packet)


def write_thumbnail(frame: object, path: str | os.PathLike[str]) -> Path:
    """One [H, W, 3] frame as a PNG at ``path``."""
    rgb = to_uint8(np.asarray(frame)[None] if not hasattr(frame, "detach")
                   else cast(Any, frame)[None])[0]  # a torch tensor
    path = Path(path)
    with atomic_path(path) as tmp:
        Image.fromarray(rgb).save(tmp, format="PNG")
    return path


def preview_png(frame: object, step: int, num_inference_steps: int) -> bytes:
    """One [H, W, 3] frame as PNG bytes that say which step they show
    (`storage.outputs.preview_step` reads it)."""
    rgb = to_uint8(np.asarray(frame)[None])[0]
    info = PngImagePlugin.PngInfo()
    info.add_text(PREVIEW_STEP_KEYWORD, f"{step}/{num_inference_steps}")
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def thumbnail_path(video_path: str | os.PathLike[str]) -> Path:
    return Path(video_path).with_suffix(".png")


def write_outputs(frames: object, video_path: str | os.PathLike[str], *,
                  fps: int = DEFAULT_FPS, audio: Soundtrack | None = None) -> tuple[Path, Path]:
    """The MP4 (with ``audio`` as its soundtrack, if any) and, next to it, a PNG thumbnail of
    the middle frame."""
    rgb = to_uint8(frames)
    video = write_video(rgb, video_path, fps=fps, audio=audio)
    thumb = write_thumbnail(rgb[len(rgb) // 2], thumbnail_path(video_path))
    return video, thumb


class OutputWriter:
    """A finished job's MP4 and thumbnail into ``store``: ``writer(frames, job_id, fps, audio)``
    (``audio``: its `Soundtrack`, or None) returns the (video, thumbnail) keys. The worker's
    ranks call it from their writer threads.

    The files are encoded into a staging directory of their own (under ``staging_dir``, the
    system's temporary directory by default), then put into the store. When the store fails it
    raises `storage.outputs.OutputStoreError` (an ``OSError``) and keeps the encoded files: called
    again for the same job, it only puts them. An encoding that fails raises what the encoder
    raised (an ``OSError`` when the staging directory is at fault) and keeps nothing. `discard`
    drops what is kept for a job that is given up; `close` drops everything.
    """

    def __init__(self, store: OutputStore, staging_dir: str | os.PathLike[str] | None = None
                 ) -> None:
        self.store = store
        self.staging_dir = staging_dir
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[Path, Path, Path]] = {}  # job id -> (dir, video, thumbnail)

    def __call__(self, frames: object, job_id: str, fps: int,
                 audio: Soundtrack | None = None) -> tuple[str, str]:
        keys = video_key(job_id), thumbnail_key(job_id)
        with self._lock:
            staged = self._staged.get(job_id)
        if staged is None:
            tmp = Path(tempfile.mkdtemp(prefix="kiln-out-", dir=self.staging_dir))
            try:
                video, thumb = write_outputs(frames, tmp / f"{job_id}.mp4", fps=fps,
                                             audio=audio)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            staged = (tmp, video, thumb)
            with self._lock:
                self._staged[job_id] = staged
        _, video, thumb = staged
        for key, path in zip(keys, (video, thumb), strict=True):
            try:
                self.store.put(key, path)
            except Exception as exc:
                raise OutputStoreError.of(key, exc) from exc
        self.discard(job_id)
        return keys

    def preview(self, frame: object, job_id: str, step: int, num_inference_steps: int) -> None:
        """A running job's preview frame (uint8 [H, W, 3]) as a PNG under `preview_key`, in
        place of the last one; raises `storage.outputs.OutputStoreError` when the store refuses
        it. Nothing is kept: the next preview replaces this one anyway."""
        key = preview_key(job_id)
        data = preview_png(frame, step, num_inference_steps)
        try:
            self.store.put_bytes(key, data)
        except Exception as exc:
            raise OutputStoreError.of(key, exc) from exc

    def drop_preview(self, job_id: str) -> None:
        """Deletes the job's preview (there may be none)."""
        key = preview_key(job_id)
        try:
            self.store.delete(key)
        except Exception as exc:
            raise OutputStoreError.of(key, exc) from exc

    def kept(self) -> list[str]:
        """The jobs whose encoded files wait for the store."""
        with self._lock:
            return list(self._staged)

    def discard(self, job_id: str) -> None:
        with self._lock:
            staged = self._staged.pop(job_id, None)
        if staged is not None:
            shutil.rmtree(staged[0], ignore_errors=True)

    def close(self) -> None:
        for job_id in self.kept():
            self.discard(job_id)


def read_video(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode an MP4 to [N, H, W, 3] uint8 RGB frames."""
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: no video frames")
    return np.stack(frames)


def read_audio(path: str | os.PathLike[str]) -> Soundtrack:
    """An MP4's first audio stream, decoded: float32 ``[channels, samples]`` and its rate, cut
    where its last packet ends (the decoder pads the last AAC frame, and the stream's duration
    is rounded to the file's millisecond timescale); ValueError when it has none."""
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path}: no audio stream")
        stream = container.streams.audio[0]
        chunks, end = [], 0
        for packet in container.demux(stream):
            if packet.pts is not None:
                # An MP4's packets carry their duration (its sample table's).
                end = max(end, packet.pts + cast(int, packet.duration))
            chunks += [f.to_ndarray() for f in stream.decode(packet)]
        rate = stream.codec_context.sample_rate
        length = round(end * cast(Fraction, stream.time_base) * rate)  # a demuxed stream's
    samples = np.concatenate(chunks, axis=1).astype(np.float32)
    return Soundtrack(samples[:, :length], rate)
