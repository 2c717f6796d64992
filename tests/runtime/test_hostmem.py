"""Host memory given back to the OS (``runtime.dlo.hostmem``), and the engine asking for it.

The allocator's settings are the whole process's, so each case runs in a process of its own: a
fresh interpreter for the module's two calls, two gloo ranks (`tests.multirank`) for the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from multirank import run_ranks
from torch import nn

from runtime.dlo import apply_dlo, hostmem
from runtime.render import memory_figures

MIB = 1 << 20

needs_glibc = pytest.mark.skipif(hostmem._glibc() is None or not Path("/proc/self/statm").exists(),
                                 reason="glibc's allocator on Linux")

# Eight 8 MiB buffers freed between small ones that stay: glibc keeps the buffers' pages (the
# first 8 MiB buffer, mapped and freed, raised its mmap threshold above their size) until
# trimmed; in a process whose threshold was fixed at 8 MiB first, they go back as they are
# freed. The module is loaded from its file: a fresh process without torch starts in a blink.
_CHURN = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("hostmem", sys.argv[1])
hostmem = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hostmem)

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def churn():
    before = rss_mib()
    big = []
    for _ in range(8):
        big.append(bytearray(8 << 20))
        kept.append(bytearray(64 << 10))
    big.clear()
    return rss_mib() - before, before

kept = []
out = {}
if sys.argv[2] == "mapped":
    out["threshold"] = hostmem.map_blocks_on_their_own(8 << 20)
first = bytearray(8 << 20)
del first
out["held_mib"], before = churn()
if sys.argv[2] == "trim":
    out["trimmed"] = hostmem.trim()
    out["after_trim_mib"] = rss_mib() - before
    print(json.dumps(out))
    sys.exit()
out["smaller_block_keeps"] = hostmem.map_blocks_on_their_own(16 << 20)
out["tiny_block_keeps"] = hostmem.map_blocks_on_their_own(1 << 20)
out["big_block_keeps"] = hostmem.map_blocks_on_their_own(64 << 20)
print(json.dumps(out))
"""


def _churn(case: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _CHURN, hostmem.__file__, case],
                          capture_output=True, text=True, env=env, timeout=60, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@needs_glibc
def test_trim_gives_back_the_pages_of_buffers_the_allocator_kept():
    out = _churn("trim")
    assert out["held_mib"] > 48  # of the 64 MiB freed
    assert out["trimmed"] is True
    assert out["after_trim_mib"] < 8


@needs_glibc
def test_buffers_of_a_block_size_or_more_go_back_on_free_once_mapped_on_their_own():
    out = _churn("mapped")
    assert out["threshold"] == 8 * MIB
    assert out["held_mib"] < 8
    # The smallest block asked for stands; one too small, or glibc's own mapped size, is ignored.
    assert out["smaller_block_keeps"] == out["tiny_block_keeps"] == out["big_block_keeps"] \
        == 8 * MIB


class _Wide(nn.Module):
    """Two 16 MiB fp32 blocks: 4 MiB and their scales in fp8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(2048, 2048, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _gathering_rank(rank: int, world: int) -> dict[str, Any]:
    bare = memory_figures()[1]
    handle = apply_dlo(_Wide(), weights_dtype="fp8")
    try:
        x = torch.ones(1, 2048)
        with torch.no_grad():
            for _ in range(6):
                handle.model(x)
        stats = handle.stats()
        return {"threshold": hostmem._threshold_bytes, "host_bytes": memory_figures()[1] - bare,
                "stored": stats["max_stored_block_bytes"],
                "kept": stats["host_shard_bytes"] + stats["device_weight_buffer_bytes"]}
    finally:
        handle.close()


@needs_glibc
def test_a_cpu_allgather_group_keeps_no_gathered_block_once_it_is_freed():
    for out in run_ranks(2, _gathering_rank):
        assert out["threshold"] == out["stored"] > hostmem.MIN_BLOCK_BYTES
        # Its shard, slots and compute buffer, not a share of the twelve gathered blocks gloo
        # allocated (measured: 31 MiB over the bare rank; 47 and 55 without the fixed threshold,
        # against 29 MiB kept and 4 MiB a block).
        assert out["host_bytes"] < out["kept"] + 3 * out["stored"], out
