"""Atomic file writes: a reader sees the whole new file or the old one, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: Path, *, prefix: str | None = None,
                suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path to write ``target`` through, renamed over ``target`` on a clean exit.

    The temporary file is created (empty, mode 0600) in ``target``'s directory, which is made if
    missing: a rename within one file system is atomic, so the new file appears all at once. If
    the block raises, the temporary file is removed and ``target`` is left as it was; a crash
    leaves at most a hidden ``<prefix>…<suffix>`` file (by default ``.<name>.…<suffix>``) behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}." if prefix is None else prefix
    # The directory held open: a failed write removes its temporary through it even when the
    # directory was moved or replaced meanwhile (its path then no longer reaches the file).
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=suffix)
        os.close(fd)
        try:
            yield Path(tmp)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(tmp).name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
