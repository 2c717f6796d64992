"""The ranks' writer: a store that refuses a job's files keeps nothing under the final names,
raises an OutputStoreError (an OSError) that says where, and the next try puts the files it
encoded before without encoding them again. A running job's preview replaces the last one and
says which step it shows."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from storage import video
from storage.outputs import (
    LocalStore,
    OutputStoreError,
    preview_key,
    preview_step,
    thumbnail_key,
    video_key,
)
from storage.video import OutputWriter

JOB = "abc123"


def _frames() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(5, 32, 32, 3), dtype=np.uint8)


class FlakyStore(LocalStore):
    """A local store whose puts fail while ``failing`` is set (as a full disk would)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing = True
        self.puts: list[str] = []

    def put(self, key: str, path: Path) -> None:
        self.puts.append(key)
        if self.failing:
            raise OSError(28, "No space left on device", str(self.root / ".tmp-x.mp4"))
        super().put(key, path)


def _count_encodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    encoded: list[str] = []
    real = video.write_outputs

    def counting(frames: Any, path: Any, *, fps: int = video.DEFAULT_FPS,
                 audio: Any = None) -> Any:
        encoded.append(str(path))
        return real(frames, path, fps=fps, audio=audio)

    monkeypatch.setattr(video, "write_outputs", counting)
    return encoded


def test_a_refused_put_keeps_the_encoded_files_and_the_next_try_only_puts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = _count_encodes(monkeypatch)
    store = FlakyStore(tmp_path / "outputs")
    writer = OutputWriter(store, staging_dir=tmp_path / "staging")
    (tmp_path / "staging").mkdir()
    for _ in range(3):
        with pytest.raises(OutputStoreError) as refused:
            writer(_frames(), JOB, 8)
        assert isinstance(refused.value, OSError)
        # One line that names the key and the cause, the same from one try to the next.
        assert str(refused.value) == (f"could not store {video_key(JOB)}: No space left on "
                                      f"device ({store.root})")
    assert len(encoded) == 1 and writer.kept() == [JOB]
    assert not store.exists(video_key(JOB)) and not store.exists(thumbnail_key(JOB))

    store.failing = False
    assert writer(_frames(), JOB, 8) == (video_key(JOB), thumbnail_key(JOB))
    assert len(encoded) == 1, "stored without encoding again"
    assert store.exists(video_key(JOB)) and store.exists(thumbnail_key(JOB))
    assert video.read_video(store.local_path(video_key(JOB))).shape == (5, 32, 32, 3)
    # Nothing is kept once stored.
    assert writer.kept() == [] and list((tmp_path / "staging").iterdir()) == []


def test_discard_and_close_drop_what_is_kept(tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    store = FlakyStore(tmp_path / "outputs")
    writer = OutputWriter(store, staging_dir=tmp_path / "staging")
    for job in ("one", "two"):
        with pytest.raises(OutputStoreError):
            writer(_frames(), job, 8)
    assert sorted(writer.kept()) == ["one", "two"]
    writer.discard("one")
    assert writer.kept() == ["two"] and len(list((tmp_path / "staging").iterdir())) == 1
    writer.close()
    assert writer.kept() == [] and list((tmp_path / "staging").iterdir()) == []


def test_an_encoding_that_fails_keeps_nothing_and_raises_what_the_encoder_raised(
        tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    writer = OutputWriter(FlakyStore(tmp_path / "outputs"), staging_dir=tmp_path / "staging")
    odd = np.zeros((3, 31, 32, 3), dtype=np.uint8)  # H.264 needs an even size
    with pytest.raises(ValueError, match="even"):
        writer(odd, JOB, 8)
    assert writer.kept() == [] and list((tmp_path / "staging").iterdir()) == []


def _unwritable(root: Path) -> Any:
    """Makes ``root`` refuse new files: read-only for a user; for root (whom modes do not stop),
    a regular file where its parent directory was."""
    if os.geteuid() != 0:
        dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
        for d in dirs:
            d.chmod(0o500)
        return lambda: [d.chmod(0o755) for d in dirs]
    parent = root.parent
    aside = parent.with_name(parent.name + ".aside")
    parent.rename(aside)
    parent.write_bytes(b"not a directory")

    def restore() -> None:
        parent.unlink()
        aside.rename(parent)

    return restore


def test_a_store_that_refuses_leaves_nothing_under_the_final_name_then_takes_the_file(
        tmp_path: Path) -> None:
    root = tmp_path / "outs" / "outputs"
    root.mkdir(parents=True)
    store = LocalStore(root)
    store.put_bytes(thumbnail_key("old"), b"the old thumbnail")
    (tmp_path / "staging").mkdir()
    writer = OutputWriter(store, staging_dir=tmp_path / "staging")
    restore = _unwritable(root)
    try:
        with pytest.raises(OutputStoreError):
            writer(_frames(), JOB, 8)
    finally:
        restore()
    # Nothing under the final names, no temporary left, the old object untouched.
    assert not store.exists(video_key(JOB)) and not store.exists(thumbnail_key(JOB))
    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["old.png"]
    with store.open(thumbnail_key("old")) as old:
        assert old.read() == b"the old thumbnail"
    assert writer(_frames(), JOB, 8) == (video_key(JOB), thumbnail_key(JOB))
    assert store.exists(video_key(JOB)) and store.exists(thumbnail_key(JOB))


def test_a_put_that_fails_midway_leaves_the_old_object_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "outputs")
    store.put_bytes(video_key(JOB), b"the old video")
    src = tmp_path / "new.mp4"
    src.write_bytes(b"x" * 100_000)

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        store.put(video_key(JOB), src)
    with store.open(video_key(JOB)) as old:
        assert old.read() == b"the old video"
    assert [p.name for p in (tmp_path / "outputs" / "videos").iterdir()] == [f"{JOB}.mp4"]


def test_a_preview_replaces_the_last_one_says_its_step_and_is_dropped_when_asked(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "outputs")
    writer = OutputWriter(store)
    frames = _frames()
    writer.preview(frames[0], JOB, 2, 8)
    writer.preview(frames[1], JOB, 4, 8)
    with store.open(preview_key(JOB)) as f:
        png = f.read()
    assert preview_step(png) == (4, 8)
    with Image.open(io.BytesIO(png)) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), frames[1])
    # Written in place of the last one: no second file, no temporary left.
    assert [p.name for p in (tmp_path / "outputs" / "previews").iterdir()] == [f"{JOB}.png"]
    writer.drop_preview(JOB)
    writer.drop_preview(JOB)  # none left: not an error
    assert not store.exists(preview_key(JOB))
    assert preview_step(b"not a png") is None
    assert preview_step(video.preview_png(frames[0], 1, 2)[:40]) is None  # cut short


def test_a_refused_preview_raises_an_output_store_error(tmp_path: Path) -> None:
    root = tmp_path / "outs" / "outputs"
    root.mkdir(parents=True)
    restore = _unwritable(root)
    try:
        with pytest.raises(OutputStoreError, match=f"could not store previews/{JOB}.png"):
            OutputWriter(LocalStore(root)).preview(_frames()[0], JOB, 1, 4)
    finally:
        restore()
