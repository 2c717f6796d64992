"""A job with a LoRA adapter through the whole service: registered over HTTP, named by a job
submitted together with the same request without it, both rendered by a real ``kiln worker --dp
2`` (the adapter loaded by the rank that takes its job). Each stored video equals a render here
with (or without) the same adapter, and the adapter's effect shows in the frames."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from servers import Service, decoded, running_service

from runtime.adapters import load_adapter, named_transformers
from runtime.models.shapes import describe
from runtime.models.tiny_adapter import NAME, WEIGHTS
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline
from storage.video import write_outputs

# A whole worker group: on PostgreSQL only in `make test` (tests/conftest.py).
pytestmark = pytest.mark.group

JOB = {"model": "kiln-tiny", "prompt": "a red circle moving left", "seed": 5, "width": 64,
       "height": 64, "num_frames": 9, "num_inference_steps": 4, "fps": 8}


@pytest.fixture
def service(db: Any, redis_client: Any, redis_prefix: str, tmp_path: Path) -> Iterator[Service]:
    with running_service(db, redis_client, redis_prefix, tmp_path, dp=2, sp=1) as svc:
        yield svc


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_job_with_an_adapter_beside_one_without_each_renders_as_a_local_render(
        service: Service, tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {service.keys['alice']}"}
    with httpx.Client(base_url=service.url, headers=auth, timeout=60) as client:
        r = client.post("/v1/adapters", data={"name": NAME, "model": "kiln-tiny"},
                        files={"file": (WEIGHTS.name, WEIGHTS.read_bytes())})
        assert r.status_code == 201, r.text
        bodies = {"with": {**JOB, "adapters": [{"id": r.json()["id"]}]}, "without": JOB}
        with ThreadPoolExecutor(max_workers=2) as pool:  # both at once: one per replica
            ids = dict(zip(bodies, pool.map(
                lambda b: client.post("/v1/jobs", json=b).json()["id"], bodies.values()),
                strict=True))
        deadline = time.monotonic() + 180
        while True:
            states = {k: client.get(f"/v1/jobs/{i}").json()["status"] for k, i in ids.items()}
            assert not {"failed", "dead", "cancelled"} & set(states.values()), states
            if set(states.values()) == {"succeeded"}:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
        served = {}
        for kind, job_id in ids.items():
            path = tmp_path / f"{kind}.mp4"
            path.write_bytes(client.get(f"/v1/jobs/{job_id}/video").content)
            served[kind] = decoded(path)
        # The group reports its ranks every few seconds: the adapter's rank counts its bytes.
        while True:
            ranks = client.get("/v1/workers").json()["data"][0]["ranks"]
            loaded = max(rank["adapter_bytes"] or 0 for rank in ranks)
            if loaded or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert loaded >= WEIGHTS.stat().st_size // 2  # the factors, kept in fp32 as stored

    pipe = load_pipeline("kiln-tiny")
    try:
        adapter = load_adapter(WEIGHTS, "kiln-tiny", named_transformers(pipe))
        request = VideoRequest(prompt=JOB["prompt"], seed=JOB["seed"], width=64, height=64,
                               num_frames=9, num_inference_steps=4)
        for kind, adapters in (("with", ((adapter, 1.0),)), ("without", ())):
            frames = frames_to_uint8(pipe.generate(replace(request, adapters=adapters))).numpy()
            local, _ = write_outputs(frames, tmp_path / f"local-{kind}.mp4", fps=8)
            assert np.array_equal(served[kind], decoded(Path(local))), kind
    finally:
        pipe.close()
    colours = {kind: describe(torch.from_numpy(v).float() / 255)[0] for kind, v in served.items()}
    assert colours == {"with": "cyan", "without": "red"}
