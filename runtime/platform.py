"""The small platform layer: streams, events, pinned host memory, free memory, collective backend.

One class per kind of device (CUDA, Ascend NPU through ``torch_npu``, CPU). The DLO engine talks
only to this interface, so the same streaming code runs on all three. On the CPU, "device memory"
is host memory, there are no streams, and overlap comes from running the transfer on a thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import psutil
import torch

log = logging.getLogger(__name__)


class Platform:
    """CPU platform; also the base class that accelerator platforms override."""

    name = "cpu"
    backend = "gloo"
    is_accelerator = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    # Streams and events. On the CPU the transfer thread itself provides the asynchrony, so a
    # stream is a no-op context and an event is complete as soon as it is recorded.
    def new_stream(self) -> Any:
        return None

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield

    def record_event(self, stream: Any = None) -> Any:
        return None

    def wait_event(self, event: Any, stream: Any = None) -> None:
        return None

    def synchronize_event(self, event: Any) -> None:
        return None

    def event_elapsed_seconds(self, start: Any, end: Any) -> float:
        return 0.0

    def synchronize(self) -> None:
        return None

    # Memory.
    def empty_host(self, num_bytes: int, *, pinned: bool) -> torch.Tensor:
        """A host byte buffer; pinned (page-locked) where the platform has a DMA engine."""
        return torch.empty(num_bytes, dtype=torch.uint8)

    def release_host(self, buf: torch.Tensor) -> None:
        return None

    def empty_device(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the forward runs in."""
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def max_memory_allocated(self) -> int:
        return 0


class CudaPlatform(Platform):
    name = "cuda"
    backend = "nccl"
    is_accelerator = True

    def __init__(self, device: torch.device | None = None) -> None:
        if device is None or device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self._registered: dict[int, torch.Tensor] = {}

    @property
    def _mod(self) -> Any:
        return torch.cuda

    def new_stream(self) -> Any:
        return self._mod.Stream(device=self.device)

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        # The transfer thread has no current device of its own; set it before using the stream.
        with self._mod.device(self.device), self._mod.stream(stream):
            yield

    def record_event(self, stream: Any = None) -> Any:
        event = self._mod.Event(enable_timing=True)
        event.record(stream if stream is not None else self._mod.current_stream(self.device))
        return event

    def wait_event(self, event: Any, stream: Any = None) -> None:
        (stream if stream is not None else self._mod.current_stream(self.device)).wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def event_elapsed_seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def synchronize(self) -> None:
        self._mod.synchronize(self.device)

    def empty_host(self, num_bytes: int, *, pinned: bool) -> torch.Tensor:
        buf = torch.empty(num_bytes, dtype=torch.uint8)
        if not pinned or num_bytes == 0:
            return buf
        # Register the exact allocation instead of `pin_memory=True`: the caching host allocator
        # rounds pinned blocks up to a power of two, up to 1.9x the bytes asked for.
        if self._register(buf):
            self._registered[buf.data_ptr()] = buf
            return buf
        log.warning("page-locking %d bytes by registration failed; using pin_memory", num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)

    def _register(self, buf: torch.Tensor) -> bool:
        cudart = torch.cuda.cudart()
        return int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) == 0

    def _unregister(self, buf: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def release_host(self, buf: torch.Tensor) -> None:
        if self._registered.pop(buf.data_ptr(), None) is not None:
            self._unregister(buf)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._mod.mem_get_info(self.device)
        return int(free), int(total)

    def max_memory_allocated(self) -> int:
        return int(self._mod.max_memory_allocated(self.device))


class NpuPlatform(CudaPlatform):
    """Ascend NPU through ``torch_npu``, which mirrors the ``torch.cuda`` API under ``torch.npu``.

    Pinned memory comes from the driver here (invisible to cgroup accounting), so no
    registration trick is needed: ``pin_memory=True`` is used as is.
    """

    name = "npu"
    backend = "hccl"

    def __init__(self, device: torch.device | None = None) -> None:
        # Here, not at the top: an optional package, present only on Ascend machines.
        import torch_npu  # noqa: F401  (registers torch.npu)

        if device is None or device.index is None:
            index = torch.npu.current_device()  # type: ignore[attr-defined]  # torch_npu adds it
            device = torch.device("npu", index)
        Platform.__init__(self, device)
        self._registered = {}

    @property
    def _mod(self) -> Any:
        return torch.npu  # type: ignore[attr-defined]  # torch_npu adds it

    def empty_host(self, num_bytes: int, *, pinned: bool) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned and num_bytes > 0)

    def release_host(self, buf: torch.Tensor) -> None:
        return None


def npu_available() -> bool:
    try:  # an optional package, present only on Ascend machines
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]  # torch_npu adds it


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if npu_available():
        index = torch.npu.current_device()  # type: ignore[attr-defined]  # torch_npu adds it
        return torch.device("npu", index)
    return torch.device("cpu")


def get_platform(device: torch.device | str | None = None) -> Platform:
    """The platform for ``device`` (default: :func:`default_device`)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return CudaPlatform(device)
    if device.type == "npu":
        return NpuPlatform(device)
    if device.type == "cpu":
        return Platform(device)
    raise ValueError(f"unsupported device type {device.type!r}; expected cuda, npu or cpu")
