"""Host memory the C allocator keeps after the engine is done with it, given back to the OS.

glibc's malloc keeps freed memory for reuse: small chunks in its arenas, and chunks of any size
below its mmap threshold, which rises (up to 32 MiB) to the size of every mapped chunk freed.
Two of the engine's host allocations are transient and would otherwise stay in a rank's memory
for good:

- building the host copy of a cast block (``weights_dtype`` bf16 or fp8) makes compute-dtype
  temporaries of every tensor, a few MiB each: `trim` once the copy is built;
- on the CPU, gloo allocates the whole gathered block anew for every all-gather and frees it
  after. A block below 32 MiB (a 67 MB fp32 block of a 1 GB Wan stored in fp8: 17 MB) then
  stays in the heap, several times over across gloo's threads: 16 MiB gathers ten times left
  63 and 95 MiB more on the two ranks, 64 MiB ones nothing. `map_blocks_on_their_own` fixes
  the threshold at the block's size, so each such buffer is its own mapping, returned on free.

Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
from typing import Any

# mallopt's parameter number for the mmap threshold (malloc.h), and the largest it takes on a
# 64-bit glibc (HEAP_MAX_SIZE / 2): from there up every allocation is mapped anyway.
_M_MMAP_THRESHOLD = -3
_MAX_THRESHOLD_BYTES = 32 << 20
# Below this, the gathers' buffers are small next to everything else a rank holds (kiln-tiny's
# blocks are under 1 MB); a lower threshold would map the forward's activations one by one.
MIN_BLOCK_BYTES = 4 << 20

_threshold_bytes: int | None = None  # the mmap threshold fixed in this process, if any


def _glibc() -> Any:
    """The process's C library where it is glibc (it has ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim() -> bool:
    """Give every free page of the allocator's arenas back to the OS (``malloc_trim``); whether
    the C library could."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def map_blocks_on_their_own(block_bytes: int) -> int | None:
    """Have every later allocation of ``block_bytes`` or more mapped on its own and unmapped
    when freed, for the whole process: glibc's mmap threshold, fixed at the smallest size any
    caller asked for (other allocations below it keep their caching). Nothing for a block under
    `MIN_BLOCK_BYTES`, or of 32 MiB or more (glibc maps those already). The threshold now in
    force, or None when none is fixed."""
    global _threshold_bytes
    if not MIN_BLOCK_BYTES <= block_bytes < _MAX_THRESHOLD_BYTES:
        return _threshold_bytes
    if _threshold_bytes is not None and _threshold_bytes <= block_bytes:
        return _threshold_bytes
    libc = _glibc()
    if libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, block_bytes) == 1:
        _threshold_bytes = block_bytes
    return _threshold_bytes
