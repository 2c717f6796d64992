"""Output stores: where finished videos and thumbnails live, and uploaded inputs.

One small interface, two implementations: `LocalStore` (a directory; the default) and `S3Store`
(any S3-compatible server; needs the ``s3`` extra). Keys come from `video_key`, `thumbnail_key`,
`preview_key` (a running job's latest preview frame) and `checkpoint_key` (its latest
denoising checkpoint), which derive them from the job id alone, and `input_key` (an uploaded
input, from its file id and checked format), so no request field ever becomes part of a path.
Every write is atomic: a write that fails leaves nothing under the key (or the object that was
there).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit

from common.files import atomic_path
from common.settings import Settings

_KEY = re.compile(r"^[a-z]+/[a-z0-9]{1,64}\.[a-z0-9]{2,4}$")


def video_key(job_id: str) -> str:
    return _checked(f"videos/{job_id}.mp4")


def thumbnail_key(job_id: str) -> str:
    return _checked(f"thumbnails/{job_id}.png")


def preview_key(job_id: str) -> str:
    """A running job's newest preview frame (PNG), replaced while it runs, deleted when it ends."""
    return _checked(f"previews/{job_id}.png")


def input_key(file_id: str, extension: str) -> str:
    """An uploaded input's bytes (`storage.input_files`); the extension is the one its checked
    content has (`storage.media`), never the client's."""
    return _checked(f"inputs/{file_id}.{extension}")


def adapter_key(sha256: str) -> str:
    """A registered LoRA adapter's ``.safetensors`` bytes, by their sha256 (hex): one object
    however many registrations name the same file."""
    return _checked(f"adapters/{sha256}.lora")


def checkpoint_key(job_id: str) -> str:
    """A running job's newest denoising checkpoint (``runtime.resume``), from which it resumes
    where it stopped."""
    return _checked(f"checkpoints/{job_id}.ckpt")


# A preview PNG's text chunk that says which step it shows: "k/n" (`storage.video.preview_png`).
PREVIEW_STEP_KEYWORD = "kiln-step"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def preview_step(png: bytes) -> tuple[int, int] | None:
    """(step, steps) a preview shows, from its text chunk, read without an image library (the
    API reads it on every request); None when it does not say."""
    if not png.startswith(_PNG_SIGNATURE):
        return None
    keyword = PREVIEW_STEP_KEYWORD.encode()
    pos = len(_PNG_SIGNATURE)
    while pos + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IDAT":  # the text chunk is written before the image data
            return None
        if kind == b"tEXt":
            name, _, text = png[pos + 8:pos + 8 + length].partition(b"\0")
            if name == keyword:
                step, _, total = text.partition(b"/")
                try:
                    return int(step), int(total)
                except ValueError:
                    return None
        pos += 12 + length  # length, type, data, CRC
    return None


def _checked(key: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"not a valid output key: {key!r}")
    return key


class OutputStoreError(OSError):
    """The output store did not take an object (a full or read-only directory, an S3 server
    that refuses or cannot be reached): weather, worth trying again, never the job's fault."""

    @classmethod
    def of(cls, key: str, exc: BaseException) -> OutputStoreError:
        """``exc``, raised while storing ``key``, in one line that stays the same from one try
        to the next (no temporary file names)."""
        if isinstance(exc, OSError) and exc.strerror:
            where = f" ({Path(exc.filename).parent})" if exc.filename else ""
            text = f"{exc.strerror}{where}"
        else:
            lines = str(exc).strip().splitlines()
            text = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
        return cls(f"could not store {key}: {text}")


class OutputStore(Protocol):
    def put(self, key: str, path: Path) -> None:
        """Stores the file at ``path`` under ``key``, atomically: readers see all of it or none."""

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def open(self, key: str) -> IO[bytes]:
        """Reads the object; raises FileNotFoundError if absent."""

    def url(self, key: str) -> str | None:
        """A direct download URL, or None when the API must stream it (`open`)."""

    def local_path(self, key: str) -> Path | None:
        """The file on this machine, when there is one (lets the API send it efficiently)."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Removes the object; absent objects are not an error."""

    def keys(self, folder: str) -> list[str]:
        """The keys of the objects in ``folder`` (``checkpoints``: every job's checkpoint)."""


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        return self.root / _checked(key)

    def put(self, key: str, path: Path) -> None:
        with self._writing(key) as out, open(path, "rb") as src:
            shutil.copyfileobj(src, out)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._writing(key) as out:
            out.write(data)

    @contextlib.contextmanager
    def _writing(self, key: str) -> Iterator[IO[bytes]]:
        """A file for the object's contents; on a clean exit it is synced and renamed over it."""
        target = self._path(key)
        with atomic_path(target, prefix=".tmp-", suffix=target.suffix) as tmp:
            with open(tmp, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())

    def open(self, key: str) -> IO[bytes]:
        return open(self._path(key), "rb")

    def url(self, key: str) -> str | None:
        return None

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self, folder: str) -> list[str]:
        found = self.root / folder
        if not found.is_dir():
            return []
        # Not the files still being written (`common.files.atomic_path`'s ".tmp-" ones).
        return sorted(f"{folder}/{p.name}" for p in found.iterdir()
                      if p.is_file() and _KEY.match(f"{folder}/{p.name}"))


class S3Store:
    """Objects under ``s3://bucket/prefix/``. An S3 PUT is atomic by itself."""

    def __init__(
        self, bucket: str, prefix: str = "", *, client: Any = None, url_expires_seconds: int = 3600,
        **client_kwargs: Any,
    ) -> None:
        if client is None:
            try:  # an optional package (the s3 extra)
                import boto3
                from botocore.config import Config
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise RuntimeError(
                    "S3 output storage needs boto3: pip install 'kiln[s3]'"
                ) from exc
            # Presigned links in the current signature (SigV4): AWS regions opened since 2014
            # and several S3-compatible stores refuse the older one, boto3's default for them.
            # SigV4 signs the region: set s3_region for a bucket outside us-east-1.
            client = boto3.client("s3", config=Config(signature_version="s3v4"),
                                  **client_kwargs)
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url_expires_seconds = url_expires_seconds

    def _name(self, key: str) -> str:
        key = _checked(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._name(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._name(key), Body=data)

    def open(self, key: str) -> IO[bytes]:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._name(key))["Body"]
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(key) from exc

    def url(self, key: str) -> str | None:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._name(key)},
            ExpiresIn=self.url_expires_seconds,
        )

    def local_path(self, key: str) -> Path | None:
        return None

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._name(key))
        except Exception:  # botocore's ClientError for 404; any failure reads as absent
            return False
        return True

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._name(key))

    def keys(self, folder: str) -> list[str]:
        start = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{start}{folder}/")
        names = (o["Key"][len(start):] for page in pages for o in page.get("Contents", ()))
        return sorted(k for k in names if _KEY.match(k))


def make_store(settings: Settings) -> OutputStore:
    """The store the settings name: S3 for ``storage_url=s3://...``, else ``output_dir``."""
    if settings.storage_url is None:
        return LocalStore(settings.output_dir)
    parts = urlsplit(settings.storage_url)
    secret = settings.s3_secret_access_key
    kwargs = {
        k: v for k, v in {
            "endpoint_url": settings.s3_endpoint_url,
            "region_name": settings.s3_region,
            "aws_access_key_id": settings.s3_access_key_id,
            "aws_secret_access_key": None if secret is None else secret.get_secret_value(),
        }.items() if v is not None
    }
    return S3Store(parts.netloc, parts.path, url_expires_seconds=settings.url_expires_seconds,
                   **kwargs)
