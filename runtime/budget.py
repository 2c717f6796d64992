"""How much device memory a rank may give to resident transformer blocks.

DLO streams every block through two slots, which costs time only when the model would have fit:
SGLang measured +60% latency from offloading a model that fits on an H200. So a rank keeps as
many blocks resident as its budget holds and streams the rest (``apply_dlo``'s
``device_budget_bytes``; the ranks agree on the smallest count).

``--device-budget`` is ``auto`` (the default), ``none`` or a size. ``auto`` on an accelerator is
the free device memory once the model's other parts are placed, less what the largest job the
deployment admits needs for its activations and what steps left part-way may keep of their
blocks' outputs (``runtime.step_replay.KEEP_MAX_BYTES``, twice: a suspended job's and the
running one's). On the CPU host memory is the device: a rank-local rank reading a checkpoint
keeps every block resident, bound to the checkpoint's shared mapping (one copy for all ranks, no
transfer per forward; ``runtime.dlo.engine``); in allgather mode, or without a checkpoint to
map, a resident block would be a private copy per rank, so none stay.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.step_replay import KEEP_MAX_BYTES

AUTO = "auto"

# The dtypes a worker group may keep and move its streamed blocks in (``apply_dlo``'s
# ``weights_dtype``; ``runtime.dlo.cast`` says which tensor becomes what). ``checkpoint``, the
# default, moves them as the checkpoint stores them.
WEIGHTS_DTYPES = ("checkpoint", "bf16", "fp8")

# A device budget as the commands take it: "auto", "none", or bytes.
DeviceBudget = int | str | None

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_budget(text: str) -> DeviceBudget:
    """``"auto"``, ``"none"`` (nothing resident) or a size such as ``"12GiB"``, ``"512MB"``,
    ``"1000000"``."""
    value = text.strip().lower()
    if value in ("auto", ""):
        return AUTO
    if value in ("none", "off", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"a device budget is 'auto', 'none' or a size such as 12GiB or 512MB, "
                         f"got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def activation_bytes(tokens: int, width: int, ffn_dim: int, dtype_bytes: int, *,
                     batch: int = 2) -> int:
    """Peak transient bytes of one block forward over ``tokens`` video tokens (this rank's
    shard under sequence parallelism): per token the residual stream, the norm's output, q, k,
    v and the attention output (6 x width) and the feed-forward's hidden layer before and
    after its activation (2 x ffn_dim), for each item of the guidance pair; a quarter more for
    the allocator's slack."""
    return int(1.25 * batch * tokens * (6 * width + 2 * ffn_dim) * dtype_bytes)


# A budget every model fits in: keep every block resident.
EVERYTHING = 2**62


def resolve_budget(budget: DeviceBudget, platform: Any, *, activations: int,
                   parts: int = 1, maps_checkpoint: bool = False) -> int | None:
    """Bytes each of ``parts`` streamed transformers may keep resident on this rank, or None
    (stream everything); ``maps_checkpoint``: the blocks come from a checkpoint in rank-local
    mode, so on the CPU a resident block is the shared mapping, not a copy."""
    if budget is None:
        return None
    if budget == AUTO:
        if not platform.is_accelerator:
            return EVERYTHING if maps_checkpoint else None
        free, _ = platform.mem_get_info()
        return max(0, free - activations - 2 * KEEP_MAX_BYTES) // parts
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"a device budget is 'auto', None or bytes >= 0, got {budget!r}")
    return budget // parts
