"""The memory figures a render reports come from psutil, and agree with the kernel's own rollup."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.render import memory_figures


def _rollup() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux")
def test_pss_and_private_bytes_are_the_rollups_and_the_peak_is_the_high_water_mark() -> None:
    before = _rollup()
    peak, pss, private = memory_figures()
    after = _rollup()
    # Read moments apart: within a few MiB of the rollups on either side.
    slack = 8 << 20
    assert min(before["Pss"], after["Pss"]) - slack <= pss <= max(before["Pss"],
                                                                  after["Pss"]) + slack
    rollup_private = [r["Private_Clean"] + r["Private_Dirty"] for r in (before, after)]
    assert min(rollup_private) - slack <= private <= max(rollup_private) + slack
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            assert abs(peak - int(line.split()[1]) * 1024) <= slack
    assert peak >= private > 0
