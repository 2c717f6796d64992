"""Zero-copy, memory-mapped access to safetensors checkpoints.

Every tensor is a view of a private (copy-on-write) file mapping, so all ranks on a node read the
same pages of the OS page cache and no rank holds a private copy of the file. The safetensors
header is parsed here rather than through ``safetensors.safe_open`` because ``get_tensor`` returns
a private copy, and the loader needs both views and the file offsets of every tensor (to drop the
byte ranges it has finished with from the page cache).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

_PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of the data in the file
    nbytes: int


class SafetensorsFile:
    """One memory-mapped safetensors file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "rb")  # noqa: SIM115  (kept open for fadvise)
        try:
            (header_len,) = struct.unpack("<Q", self._fh.read(8))
            header = json.loads(self._fh.read(header_len))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            self._fh.close()
            raise ValueError(f"{self.path}: not a safetensors file ({exc})") from exc
        data_start = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                self._fh.close()
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype "
                                 f"{entry['dtype']}")
            begin, end = entry["data_offsets"]
            self.tensors[name] = TensorInfo(
                _DTYPES[entry["dtype"]], tuple(entry["shape"]), data_start + begin, end - begin
            )
        size = os.fstat(self._fh.fileno()).st_size
        # ACCESS_COPY maps the file MAP_PRIVATE: reads share the page cache, and a stray write
        # would make a private page instead of corrupting the file or faulting.
        self._mmap = mmap.mmap(self._fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        self._bytes = (
            torch.frombuffer(self._mmap, dtype=torch.uint8) if self._mmap is not None
            else torch.empty(0, dtype=torch.uint8)
        )

    def byte_view(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return self._bytes[info.start : info.start + info.nbytes]

    def tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        raw = self.byte_view(name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return raw.view(info.dtype).view(info.shape)

    def release(self, start: int, end: int) -> None:
        """Drop file bytes [start, end) from this mapping and, if unmapped elsewhere, the cache.

        Only whole pages inside the range are dropped, so neighbouring bytes that another rank
        still needs are never touched.
        """
        first = -(-start // _PAGE) * _PAGE
        last = (end // _PAGE) * _PAGE
        if last <= first or self._mmap is None:
            return
        self._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)
        os.posix_fadvise(self._fh.fileno(), first, last - first, os.POSIX_FADV_DONTNEED)

    def unmap_all(self) -> None:
        """Drop every page of the file from this process's mapping (the views stay valid).

        Page faults map neighbouring cached pages too ("fault-around"), so a rank ends up
        mapping pages another rank read; while mapped, the other rank cannot evict them.
        """
        if self._mmap is not None:
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view handed out earlier is still alive; the mapping goes when it does.
                pass
        self._fh.close()


class Checkpoint:
    """A set of safetensors files seen as one name -> tensor mapping."""

    def __init__(self, files: Sequence[str | os.PathLike[str]]) -> None:
        self.files = [SafetensorsFile(f) for f in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise ValueError(
                        f"checkpoint key {name!r} appears in both {self._where[name].path} "
                        f"and {f.path}"
                    )
                self._where[name] = f

    @classmethod
    def open(cls, spec: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Checkpoint:
        """A file, a directory (HF ``*.index.json`` honoured when present) or a list of files."""
        if isinstance(spec, str | os.PathLike):
            return cls(resolve_files(Path(spec)))
        files = [Path(p) for p in spec]
        if not files:
            raise ValueError("checkpoint is an empty list of files")
        return cls(files)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def tensor(self, name: str) -> torch.Tensor:
        return self._where[name].tensor(name)

    def byte_view(self, name: str) -> torch.Tensor:
        return self._where[name].byte_view(name)

    def release(self, name: str, begin: int, end: int) -> None:
        """Drop bytes [begin, end) of tensor ``name`` from the page cache (see SafetensorsFile)."""
        f = self._where[name]
        start = f.tensors[name].start
        f.release(start + begin, start + end)

    def unmap_all(self) -> None:
        for f in self.files:
            f.unmap_all()

    def close(self) -> None:
        for f in self.files:
            f.close()


def resolve_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"checkpoint directory {path} has several index files: "
                         f"{[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{indexes[0]} names files that are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint directory {path} holds no .safetensors files")
    return files

