"""`kiln up` with kiln-tiny registers its demo adapter, shared, so a user can name it at once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from servers import kiln_up

from runtime.models.tiny_adapter import NAME


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
def test_kiln_up_registers_the_demo_adapter_for_everyone(tmp_path: Path) -> None:
    with kiln_up(tmp_path, "--dp", "1") as (base, key):
        deadline = time.monotonic() + 60
        while True:
            listed = httpx.get(f"{base}/v1/adapters", params={"model": "kiln-tiny"},
                               headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
            found = [(a["name"], a["shared"], a["rank"]) for a in listed["data"]]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert found == [(NAME, True, 8)]
