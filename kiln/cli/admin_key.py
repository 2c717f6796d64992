"""``kiln up``'s admin key: one key, kept in ``<data dir>/admin.key`` (mode 0600) and reused
across starts, replaced only when it no longer works or is rotated (the old one revoked then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy.orm import Session

from storage.users import authenticate, create_api_key, key_prefix, revoke_api_key

FILE_NAME = "admin.key"
USER = "admin"


@dataclass(frozen=True, slots=True)
class AdminKey:
    key: str
    prefix: str
    # kept: the file's key, still active; new: the file had none that works (none, revoked,
    # another database's); rotated: asked for, the file's key revoked.
    how: Literal["kept", "new", "rotated"]


def path(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def read(data_dir: Path) -> str | None:
    """The key in the data directory's file; None without one."""
    try:
        return path(data_dir).read_text().strip() or None
    except FileNotFoundError:
        return None


def write(data_dir: Path, key: str) -> Path:
    """Writes ``key`` to the data directory's file, readable by this user only from the first
    byte on (a new file, then renamed over the old one)."""
    target = path(data_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{FILE_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file left from a crash may have had other bits
        f.write(key + "\n")
    os.replace(tmp, target)
    return target


def ensure(session: Session, data_dir: Path, *, rotate: bool = False) -> AdminKey:
    """The admin key ``kiln up`` prints: the file's, while it authenticates as an admin (and
    ``rotate`` is not asked), else a new one, written to the file before the old one is
    revoked."""
    old = read(data_dir)
    user = authenticate(session, old) if old else None
    session.commit()  # ends the read
    old_prefix = key_prefix(old) if old and user is not None else None
    if old and old_prefix and user is not None and user.is_admin and not rotate:
        os.chmod(path(data_dir), 0o600)
        return AdminKey(old, old_prefix, "kept")
    new = create_api_key(session, USER, is_admin=True)
    write(data_dir, new.key)
    if old_prefix is not None:  # still active: rotated, or no longer an admin's
        revoke_api_key(session, old_prefix)
    return AdminKey(new.key, new.prefix, "rotated" if rotate and old_prefix else "new")
