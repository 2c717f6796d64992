"""The one atomic write: the new file appears whole under its name or not at all, and a write
that fails leaves no temporary behind, even when its directory is moved away mid-write."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.files import atomic_path


def test_a_clean_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out" / "a.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".a.png.")
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["a.png"]


def test_a_write_that_fails_after_its_directory_moved_leaves_no_temporary(
        tmp_path: Path) -> None:
    # What a store's directory pulled away mid-write looks like: the temporary's path no longer
    # reaches it, and once the directory is back, nothing of the write may be left in it.
    outputs = tmp_path / "outputs"
    target = outputs / "previews" / "a.png"
    aside = tmp_path / "outputs.aside"
    with pytest.raises(NotADirectoryError), atomic_path(target) as tmp:
        outputs.rename(aside)
        outputs.write_bytes(b"not a directory")
        tmp.write_bytes(b"new")  # ENOTDIR, as for every write under the moved directory
    outputs.unlink()
    aside.rename(outputs)
    assert list((outputs / "previews").iterdir()) == []
