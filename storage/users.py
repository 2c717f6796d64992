"""Users and API keys. A key is shown once at creation; the database keeps only its SHA-256.

Key format: ``kiln_`` + 12 lowercase letters/digits (the visible, indexed prefix) + 40 random
url-safe characters. The prefix finds the row; the hash of the whole key is compared in constant
time, so the stored data cannot be used to authenticate.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.tables import ApiKey, User, utcnow

KEY_SCHEME = "kiln_"
PREFIX_LENGTH = 12
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
_SECRET_ALPHABET = string.ascii_letters + string.digits
_SECRET_LENGTH = 40
KEY_LENGTH = len(KEY_SCHEME) + PREFIX_LENGTH + _SECRET_LENGTH


@dataclass(frozen=True, slots=True)
class NewKey:
    user: User
    key: str  # the plain key: print it once, it cannot be recovered
    prefix: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_user(session: Session, name: str, *, is_admin: bool = False) -> User:
    """The user called ``name``, created if new; an existing user is promoted if ``is_admin``."""
    if not name or len(name) > 64 or not name.isprintable():
        raise ValueError("user name must be 1-64 printable characters")
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        user = User(name=name, is_admin=is_admin)
        session.add(user)
    elif is_admin and not user.is_admin:
        user.is_admin = True
    session.flush()
    return user


def user_named(session: Session, name: str) -> User | None:
    return session.scalar(select(User).where(User.name == name))


def key_prefix(key: str) -> str | None:
    """The prefix of a well-formed key (what `list_api_keys` shows of it); None otherwise."""
    if len(key) != KEY_LENGTH or not key.startswith(KEY_SCHEME):
        return None
    prefix = key[len(KEY_SCHEME) : len(KEY_SCHEME) + PREFIX_LENGTH]
    return prefix if all(c in _PREFIX_ALPHABET for c in prefix) else None


def _add_key(session: Session, user: User) -> NewKey:
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(_SECRET_LENGTH))
    key = f"{KEY_SCHEME}{prefix}{secret}"
    session.add(ApiKey(user_id=user.id, prefix=prefix, key_hash=hash_key(key)))
    return NewKey(user=user, key=key, prefix=prefix)


def create_api_key(session: Session, user_name: str, *, is_admin: bool = False) -> NewKey:
    """Creates (or reuses) the user and a new key for them; commits."""
    new = _add_key(session, get_or_create_user(session, user_name, is_admin=is_admin))
    session.commit()
    return new


def revoke_api_key(session: Session, prefix: str) -> bool:
    """Revokes the active key ``prefix``; False if there is none. The API refuses it within
    ``api_key_cache_seconds``, open event streams included."""
    key = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if key is None or key.revoked_at is not None:
        return False
    key.revoked_at = utcnow()
    session.commit()
    return True


def rotate_api_key(session: Session, prefix: str) -> NewKey | None:
    """A new key for the user of the active key ``prefix``, which is revoked in the same
    commit; None if there is no such key."""
    old = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix,
                                              ApiKey.revoked_at.is_(None)))
    if old is None:
        return None
    user = session.get(User, old.user_id)
    assert user is not None  # the foreign key
    new = _add_key(session, user)
    old.revoked_at = utcnow()
    session.commit()
    return new


def list_api_keys(session: Session) -> list[tuple[ApiKey, User]]:
    rows = session.execute(
        select(ApiKey, User).join(User, User.id == ApiKey.user_id).order_by(ApiKey.id)
    )
    return [(k, u) for k, u in rows]


def authenticate(session: Session, key: str) -> User | None:
    """The active user holding ``key``, or None for a malformed, unknown or revoked key."""
    prefix = key_prefix(key)
    if prefix is None:
        return None  # also keeps NUL and other junk out of the SQL parameter
    row = session.execute(
        select(ApiKey.key_hash, User)
        .join(User, User.id == ApiKey.user_id)
        .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None), User.disabled.is_(False))
    ).first()
    if row is None or not hmac.compare_digest(row[0], hash_key(key)):
        return None
    return row[1]
