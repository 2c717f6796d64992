"""Video outputs: H.264 MP4 and PNG thumbnail, written atomically."""

from __future__ import annotations

import av
import numpy as np
import pytest
from PIL import Image

from storage import video


def _frames(n=9, h=64, w=48):
    rng = np.random.default_rng(0)
    return rng.random((n, h, w, 3), dtype=np.float32)


def test_mp4_is_h264_and_decodes_to_the_frames_written(tmp_path):
    frames = _frames()
    path = video.write_video(frames, tmp_path / "a.mp4")
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name == "h264"
    decoded = video.read_video(path)
    assert decoded.shape == (9, 64, 48, 3) and decoded.dtype == np.uint8
    # A smooth image survives H.264 at crf 18 almost exactly (random noise would not).
    smooth = np.broadcast_to(np.linspace(0, 1, 48, dtype=np.float32)[None, None, :, None],
                             (5, 64, 48, 3))
    back = video.read_video(video.write_video(smooth, tmp_path / "s.mp4")).astype(int)
    assert np.abs(back - video.to_uint8(smooth).astype(int)).mean() < 2


def _top_level_boxes(data: bytes) -> list[str]:
    """The types of an MP4's top-level boxes, in file order."""
    boxes, at = [], 0
    while at + 8 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        boxes.append(data[at + 4:at + 8].decode("latin-1"))
        if size == 1:  # a 64-bit size follows the type
            size = int.from_bytes(data[at + 8:at + 16], "big")
        if size < 8:
            break
        at += size
    return boxes


def test_the_index_comes_before_the_frames_so_a_browser_plays_it_as_it_arrives(tmp_path):
    boxes = _top_level_boxes(video.write_video(_frames(), tmp_path / "a.mp4").read_bytes())
    assert "moov" in boxes and "mdat" in boxes, boxes
    assert boxes.index("moov") < boxes.index("mdat"), boxes


def test_same_frames_give_the_same_file_bytes(tmp_path):
    a = video.write_video(_frames(), tmp_path / "a.mp4").read_bytes()
    b = video.write_video(_frames(), tmp_path / "b.mp4").read_bytes()
    assert a == b


def test_outputs_are_mp4_plus_png_thumbnail_of_the_middle_frame(tmp_path):
    frames = _frames()
    mp4, png = video.write_outputs(frames, tmp_path / "out" / "job.mp4")
    assert mp4 == tmp_path / "out" / "job.mp4" and png == tmp_path / "out" / "job.png"
    thumb = np.asarray(Image.open(png))
    assert np.array_equal(thumb, video.to_uint8(frames)[4])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["job.mp4", "job.png"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.mp4"
    path.write_bytes(b"previous")

    def broken(*args, **kwargs):
        raise RuntimeError("encoder died")

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", broken)
    with pytest.raises(RuntimeError, match="encoder died"):
        video.write_video(_frames(), path)
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["a.mp4"]


def test_odd_sizes_and_bad_shapes_are_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="even width and height"):
        video.write_video(_frames(h=63), tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"\[N, H, W, 3\]"):
        video.write_video(np.zeros((9, 64, 64)), tmp_path / "a.mp4")
    assert list(tmp_path.iterdir()) == []


def test_to_uint8_rounds_like_diffusers_and_clips():
    x = np.array([[[[0.0, 0.5, 1.2]]]], dtype=np.float32)
    assert video.to_uint8(x).tolist() == [[[[0, 128, 255]]]]
