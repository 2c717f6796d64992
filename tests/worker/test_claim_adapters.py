"""A claimed job with LoRA adapters: its ticket names where each adapter's file is stored, its
hash and scale (never the bytes); the rank loads it into its cache when it takes the job and
renders what a local render with the same adapter renders; a job whose adapter was deleted after
it was submitted fails at the claim with the reason, not on a rank."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import save
from sqlalchemy.orm import Session

from common.settings import Settings
from kiln.group_io import ServerIO
from runtime.adapter_cache import AdapterCache, AdapterRef
from runtime.adapters import load_adapter, named_transformers
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.rank_loop import RankLoop, Rendered, StepPlan, Ticket
from scheduler import queue_index
from storage import adapters, submission
from storage.outputs import LocalStore
from storage.submission import JobSpec
from storage.tables import Job, JobState
from storage.users import get_or_create_user
from tests.conftest import REDIS_URL

PLATFORM = SimpleNamespace(mem_get_info=lambda: (1, 2), device="cpu", is_accelerator=False)
DIM = 128  # kiln-tiny's width


def tiny_lora(seed: int = 0, rank: int = 4) -> bytes:
    """A rank-``rank`` LoRA on every block's attention output of kiln-tiny."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for block in range(4):
        prefix = f"transformer.blocks.{block}.attn_out"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, DIM, generator=gen) * 0.1
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(DIM, rank, generator=gen) * 0.1
    return save(tensors)


class Frames:
    """The ranks' ``write``: keeps each job's frames."""

    def __init__(self) -> None:
        self.frames: dict[str, np.ndarray] = {}

    def __call__(self, frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        self.frames[job_id] = np.asarray(frames)
        return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"


def render(loop: RankLoop, write: Frames, ticket: Ticket) -> np.ndarray:
    loop.apply(StepPlan(assign={0: ticket}, step=True))
    while not isinstance(loop.step(), Rendered):
        pass
    loop.reported()
    for _ in range(200):
        if ticket.job_id in write.frames:
            break
        loop.written(wait=0.05)
    return write.frames[ticket.job_id]


@pytest.fixture(scope="module")
def tiny_pipe() -> TinyPipeline:
    return TinyPipeline.load(offload=False)


def _hooked(pipe: TinyPipeline) -> int:
    return sum(hasattr(m, "_kiln_lora_hook") for m in pipe.model.transformer.modules())


def _setup(db, session: Session, r: redis.Redis, prefix: str,  # noqa: ANN001
           tmp_path: Path) -> tuple[ServerIO, Job, LocalStore, Any, bytes]:
    settings = Settings(_env_file=None, database_url=db.url, redis_url=REDIS_URL,  # type: ignore[call-arg]
                        redis_prefix=prefix, output_dir=tmp_path / "outputs")
    store = LocalStore(settings.output_dir)
    owner = get_or_create_user(session, "alice")
    data = tiny_lora()
    row = adapters.new_adapter(owner, name="attn", model="kiln-tiny", family="kiln-tiny",
                               rank=4, sha256=hashlib.sha256(data).hexdigest(),
                               size_bytes=len(data))
    store.put_bytes(row.storage_key, data)
    session.add(row)
    session.commit()
    spec = JobSpec(model="kiln-tiny", prompt="a red circle moving left", width=64, height=64,
                   num_frames=9, fps=8, num_inference_steps=4, guidance_scale=5.0, seed=3,
                   adapters=[{"id": row.id, "scale": 0.75}])
    job = submission.create_job(session, owner, spec, request_hash="h").job
    queue_index.add(r, prefix, [job])
    io_ = ServerIO(settings, group_id="g1", model="kiln-tiny", sp=1,
                   notify=lambda s, j: None, send_event=lambda *a: None)
    return io_, job, store, row, data


def test_a_job_with_an_adapter_renders_differently_and_as_a_local_render_with_it(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path, tiny_pipe: TinyPipeline) -> None:
    group, job, store, row, data = _setup(db, session, redis_client, redis_prefix, tmp_path)
    try:
        [claimed] = group.claim([0], [], prefer="interactive", job_class=None)
    finally:
        group.close()
    ticket = claimed.ticket
    assert ticket.adapters == (AdapterRef(key=row.storage_key, sha256=row.sha256, scale=0.75,
                                          name="attn"),)

    def read(key: str) -> bytes:
        with store.open(key) as f:
            return f.read()

    cache = AdapterCache(read, "kiln-tiny", tiny_pipe, budget_bytes=10**8)
    write = Frames()
    loop = RankLoop(0, tiny_pipe, write, PLATFORM, adapters=cache)  # type: ignore[arg-type]
    plain_ticket = Ticket(job_id="plain", attempt_token="t", request=ticket.request)
    try:
        before = render(loop, write, replace(plain_ticket, job_id="before"))
        adapted = render(loop, write, ticket)
        assert _hooked(tiny_pipe) == 4  # the four Linears the adapter adapts
        again = render(loop, write, replace(ticket, job_id="again"))
        plain = render(loop, write, plain_ticket)
        assert _hooked(tiny_pipe) == 0  # a job without adapters runs the transformer bare
    finally:
        loop.close()
    assert cache.loads == 1  # the second job found it loaded
    assert cache.figures()["adapters_loaded"] == 1
    assert np.array_equal(adapted, again)
    assert np.array_equal(plain, before)
    assert np.abs(adapted.astype(int) - plain.astype(int)).mean() > 1.0

    # A render here with the file loaded by hand gives the same frames, bit for bit.
    path = tmp_path / "attn.safetensors"
    path.write_bytes(data)
    local = load_adapter(path, "kiln-tiny", named_transformers(tiny_pipe))
    request: VideoRequest = replace(ticket.request, adapters=((local, 0.75),))
    write = Frames()
    loop = RankLoop(0, tiny_pipe, write, PLATFORM)  # type: ignore[arg-type]
    try:
        by_hand = render(loop, write, Ticket(job_id="local", attempt_token="t", request=request))
    finally:
        loop.close()
    assert np.array_equal(adapted, by_hand)


def test_a_job_whose_adapter_was_deleted_fails_at_the_claim_with_the_reason(
        db, session: Session, redis_client: redis.Redis, redis_prefix: str,  # noqa: ANN001
        tmp_path: Path) -> None:
    group, job, _, row, _ = _setup(db, session, redis_client, redis_prefix, tmp_path)
    adapters.forget_adapter(session, row)
    try:
        assert group.claim([0], [], prefer="interactive", job_class=None) == []
    finally:
        group.close()
    session.expire_all()
    failed = session.get(Job, job.id)
    assert failed.state == JobState.FAILED and failed.error_code == "adapter_unavailable"
    assert "was deleted before the job ran" in failed.error


def test_the_cache_evicts_the_least_recently_used_under_its_budget(tiny_pipe: TinyPipeline
                                                                   ) -> None:
    files = {f"k{i}": tiny_lora(seed=i) for i in range(3)}
    refs = {key: AdapterRef(key=key, sha256=hashlib.sha256(data).hexdigest(), scale=1.0)
            for key, data in files.items()}
    one = 4 * 4 * (DIM + DIM) * 4  # 4 layers of rank-4 factors in fp32; no copy on the CPU
    cache = AdapterCache(files.__getitem__, "kiln-tiny", tiny_pipe, budget_bytes=2 * one)
    cache.get([refs["k0"]])
    cache.get([refs["k1"]])
    assert cache.used_bytes == 2 * one
    cache.get([refs["k0"]])  # k1 is now the least recently used
    cache.get([refs["k2"]])
    assert cache.loads == 3 and cache.used_bytes == 2 * one
    cache.get([refs["k0"]])
    assert cache.loads == 3  # still there
    cache.get([refs["k1"]])
    assert cache.loads == 4  # it was evicted
    with pytest.raises(ValueError, match="not the one registered"):
        cache.get([replace(refs["k2"], sha256="0" * 64)])
    with pytest.raises(ValueError, match="over this rank's adapter budget"):
        AdapterCache(files.__getitem__, "kiln-tiny", tiny_pipe, budget_bytes=one - 1).get(
            [refs["k0"]])
