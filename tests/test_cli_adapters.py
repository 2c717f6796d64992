"""`kiln adapters add/list/rm` and `kiln submit --adapter NAME[:SCALE]` against the real API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from servers import Service, serving_api
from sqlalchemy import select

from kiln.cli.up import DEMO_ADAPTER, DEMO_ADAPTER_FILE, register_demo_adapter
from runtime.models import tiny_adapter
from storage.tables import Job
from storage.users import create_api_key


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with serving_api(db, redis_client, redis_prefix, tmp_path, users=("alice", "bob"),
                     redis_url="redis://unused", reconcile_interval_seconds=3600) as svc:
        yield svc


def lora(path: Path, fan_in: int = 128) -> Path:
    """A rank-2 LoRA on kiln-tiny's first block's attention output (128 -> 128)."""
    save_file({"transformer.blocks.0.attn_out.lora_A.weight": torch.zeros(2, fan_in),
               "transformer.blocks.0.attn_out.lora_B.weight": torch.zeros(128, 2)}, path)
    return path


def test_add_list_submit_with_an_adapter_and_rm(service: Service, tmp_path: Path) -> None:
    added = service.kiln("adapters", "add", str(lora(tmp_path / "squares.safetensors")))
    assert added.exit_code == 0, added.output
    adapter_id = added.output.strip()
    listed = service.kiln("adapters", "list")
    assert "squares" in listed.output and adapter_id in listed.output
    assert "squares" not in service.kiln("adapters", "list", who="bob").output

    submitted = service.kiln("submit", "a red square", "--adapter", "squares:0.5")
    assert submitted.exit_code == 0, submitted.output
    with service.db.session() as s:
        assert s.scalar(select(Job.adapters).where(Job.id == submitted.output.strip())) == [
            {"id": adapter_id, "scale": 0.5}]

    assert service.kiln("adapters", "rm", "squares").exit_code == 0
    refused = service.kiln("submit", "a red square", "--adapter", "squares")
    assert refused.exit_code == 1 and "no adapter named 'squares'" in refused.output


def test_a_file_that_does_not_fit_is_refused_with_the_apis_reason(service: Service,
                                                                    tmp_path: Path) -> None:
    result = service.kiln("adapters", "add", str(lora(tmp_path / "bad.safetensors", fan_in=64)))
    assert result.exit_code == 1
    assert "shape mismatch at 'blocks.0.attn_out'" in result.output and "HTTP 422" in result.output
    bad_scale = service.kiln("submit", "x", "--adapter", "squares:lots")
    assert bad_scale.exit_code == 2 and "NAME[:SCALE]" in bad_scale.output


def test_kiln_up_registers_the_demo_adapter_shared_once(service: Service) -> None:
    assert (DEMO_ADAPTER, DEMO_ADAPTER_FILE) == (tiny_adapter.NAME, tiny_adapter.WEIGHTS.name)
    with service.db.session() as s:
        root = create_api_key(s, "root", is_admin=True).key
    assert register_demo_adapter(service.url, root) == "registered"
    assert register_demo_adapter(service.url, root) == "kept"
    listed = service.kiln("adapters", "list", who="bob")
    assert DEMO_ADAPTER in listed.output and "yes" in listed.output
    submitted = service.kiln("submit", "a red circle", "--adapter", DEMO_ADAPTER, who="bob")
    assert submitted.exit_code == 0, submitted.output
    assert register_demo_adapter(service.url, "kiln_wrong").startswith("not registered")
