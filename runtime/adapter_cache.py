"""The LoRA adapters a rank keeps loaded: an LRU cache under a byte budget, keyed by the sha256
of each file's bytes.

A job names its adapters on its ticket (`AdapterRef`: where the rank reads the file in the
output store, its sha256, the job's scale); the bytes never travel on the mailbox. When the rank
takes the job (`runtime.rank_loop.RankLoop._take`, before its first step) `AdapterCache.get`
reads and checks each adapter the cache lacks (`runtime.adapters.load_adapter`, against this
rank's own transformers) and places its factors on the rank's device, so a step only computes.
A job without adapters never calls it.

The budget counts each adapter's factors as loaded plus their device copy (none on a CPU
rank, whose copy is the tensor itself). Loading one past the budget evicts the least recently
used adapters; a job already holding an evicted adapter keeps it until it ends. An adapter
larger than the whole budget fails the job that names it.

A job without adapters pays nothing: a rank takes the hooks off (`AdapterCache.unhook`) when it
takes such a job and holds none with adapters, so its forwards run without a hook call.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from runtime.adapters import Adapter, load_adapter, named_transformers, remove_adapter_hooks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One adapter of a job, as its ticket carries it."""

    key: str  # the file's key in the output store
    sha256: str  # of the file's bytes: the cache's key, checked when read
    scale: float
    name: str = ""


class AdapterCache:
    """``read(key)``: the bytes of a stored object; ``family``: the model's family (a
    ``common.families`` name); ``pipe``: the rank's pipeline, whose transformers the adapters
    are checked against and whose device they are placed on."""

    def __init__(self, read: Callable[[str], bytes], family: str, pipe: Any,
                 budget_bytes: int) -> None:
        self.read = read
        self.family = family
        self.pipe = pipe
        self.budget_bytes = budget_bytes
        self.device = torch.device(getattr(pipe, "device", "cpu"))
        self._loaded: OrderedDict[str, tuple[Adapter, int]] = OrderedDict()  # sha -> (, bytes)
        self.loads = 0  # files read and checked (a hit reads nothing)
        self.hooked = False  # a job with adapters was taken since the hooks were last removed

    def get(self, refs: Sequence[AdapterRef]) -> tuple[tuple[Adapter, float], ...]:
        """The job's ``(Adapter, scale)`` pairs, in its order; a ``ValueError`` says why one
        cannot be used (not readable, not the registered bytes, not fitting this model)."""
        self.hooked = True  # the job's first step installs their hooks
        return tuple((self._adapter(ref), ref.scale) for ref in refs)

    def unhook(self) -> None:
        """Takes the adapters' hooks off the pipeline's Linears (`remove_adapter_hooks`) if a
        job with adapters may have installed them: the next job without adapters then runs
        the transformer bare. The adapters stay loaded; the next job with one hooks again."""
        if self.hooked:
            removed = remove_adapter_hooks(self.pipe)
            self.hooked = False
            log.info("adapter hooks taken off %d Linears", removed)

    @property
    def used_bytes(self) -> int:
        return sum(size for _, size in self._loaded.values())

    def figures(self) -> dict[str, int]:
        """For the rank's report (``/v1/workers``)."""
        return {"adapter_bytes": self.used_bytes, "adapter_budget_bytes": self.budget_bytes,
                "adapters_loaded": len(self._loaded)}

    def _adapter(self, ref: AdapterRef) -> Adapter:
        hit = self._loaded.get(ref.sha256)
        if hit is not None:
            self._loaded.move_to_end(ref.sha256)
            return hit[0]
        try:
            data = self.read(ref.key)
        except OSError as exc:
            raise ValueError(f"adapter {ref.name or ref.sha256}: cannot be read ({exc})") from exc
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ValueError(f"adapter {ref.name or ref.sha256}: the stored file is not the one "
                             "registered")
        transformers = named_transformers(self.pipe)
        with tempfile.TemporaryDirectory(prefix="kiln-adapter-") as tmp:
            path = Path(tmp) / "adapter.safetensors"
            path.write_bytes(data)
            adapter = load_adapter(path, self.family, transformers, name=ref.name or None)
        size = adapter.num_bytes + _place(adapter, transformers, self.device)
        if size > self.budget_bytes:
            raise ValueError(f"adapter {adapter.name}: {size:,} bytes loaded, over this rank's "
                             f"adapter budget of {self.budget_bytes:,}")
        while self._loaded and self.used_bytes + size > self.budget_bytes:
            sha, (old, _) = self._loaded.popitem(last=False)
            log.info("adapter %s (%s) evicted for %s", old.name, sha[:12], adapter.name)
        self._loaded[ref.sha256] = (adapter, size)
        self.loads += 1
        log.info("adapter %s loaded: %d layers, %d bytes", adapter.name, len(adapter.layers),
                 size)
        return adapter


def _place(adapter: Adapter, transformers: dict[str, nn.Module], device: torch.device) -> int:
    """Copies every layer's factors to where its Linear computes (the pipeline's device, in the
    Linear's dtype) now, rather than in the step's first forward; the bytes those copies
    added."""
    model = transformers[adapter.target]
    added = 0
    for module_name, layer in adapter.layers.items():
        linear = cast(nn.Linear, model.get_submodule(module_name))  # load_adapter checked it
        placed = layer.on(device, linear.weight.dtype)
        added += sum(t.numel() * t.element_size() for t, loaded in
                     zip(placed, (layer.down, layer.up, layer.up_bias), strict=True)
                     if t is not None and t is not loaded)
    return added
