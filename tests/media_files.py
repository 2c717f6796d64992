"""Input files for the tests of `storage.media` and the upload routes, made in memory: valid ones
of every accepted format, and hostile ones made cheaply (no 30,000x30,000 image is ever
allocated; the 100,000-frame MP4 repeats one encoded frame's packet)."""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
from PIL import Image


def png(width: int = 40, height: int = 24, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int = 40, height: int = 24, orientation: int | None = None) -> bytes:
    """A JPEG; with ``orientation``, its EXIF Orientation tag (6: shown turned 90 degrees
    clockwise, so a 40x24 file is shown 24x40)."""
    image = Image.new("RGB", (width, height), (30, 200, 30))
    image.paste((255, 255, 255), (0, 0, width // 4, height // 4))  # a mark at the top left
    buf = io.BytesIO()
    if orientation is None:
        image.save(buf, "JPEG", quality=95)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(buf, "JPEG", quality=95, exif=exif)
    return buf.getvalue()


def webp(width: int = 40, height: int = 24) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 30, 200)).save(buf, "WEBP", lossless=True)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` RGB pixels, with one small (and far
    too short) compressed row: a decompression bomb's shape, a few dozen bytes long."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))


def video(codec: str = "libx264", container: str = "mp4", frames: int = 9, size: int = 16,
          fps: int = 8) -> bytes:
    """A small video of ``frames`` frames, each a different grey."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((size, size, 3), (i * 20) % 256, np.uint8), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def mp4_of_repeated_frames(frames: int, *, fps: int = 1000) -> bytes:
    """An H.264 MP4 of ``frames`` frames that its header declares and that all decode: one
    encoded key frame, then one encoded "same as before" frame's packet muxed again and again
    (100,000 frames in about 1.3 MB and half a second)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast", "tune": "zerolatency"}
        packets = []
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            frame.pts = i
            packets += stream.encode(frame)
        packets += stream.encode()
        time_base = packets[0].time_base
        key, same = bytes(packets[0]), bytes(packets[1])
        for i in range(frames):
            packet = av.Packet(key if i == 0 else same)
            packet.pts = packet.dts = i
            packet.time_base = time_base
            packet.is_keyframe = i == 0
            packet.stream = stream
            out.mux(packet)
    return buf.getvalue()


def mp4_with_a_gap(seconds: int) -> bytes:
    """Three frames, the last shown ``seconds`` s after the first: a short file, a long video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=1)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1)
        for pts in (0, 1, seconds):
            frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            frame.pts = pts
            frame.time_base = Fraction(1, 1)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
