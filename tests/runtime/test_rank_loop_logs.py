"""A replica's leader logs its job's life with the job and its attempt as the line's fields
(`common.logs`): taken, its first and last steps and one at least every STEP_LOG_SECONDS
between, its stored files; the replica's other ranks say nothing of it."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common import logs
from runtime import rank_loop
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.rank_loop import RankLoop, StepPlan, Ticket
from runtime.sequence import SOLO, Layout

STEPS = 5
PLATFORM = SimpleNamespace(mem_get_info=lambda: (1, 2), device="cpu", is_accelerator=False)


class Pipe:
    handles: list[Any] = []
    last_step_figures: dict[str, int] = {}  # a step's counts (none here)

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        return []

    def prepare(self, request: VideoRequest) -> DenoiseState:
        return DenoiseState(request=request, latents=torch.zeros(1), num_inference_steps=STEPS)

    def step(self, state: DenoiseState, active: Any = None) -> None:
        state.step_index += 1

    def idle_step(self, active: Any = None) -> None:
        pass

    def decode(self, state: DenoiseState) -> torch.Tensor:
        return torch.zeros((3, 8, 8, 3))

    def close(self) -> None:
        pass


def _write(frames: Any, job_id: str, fps: int, *audio: Any) -> tuple[str, str]:
    return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"


def _lines(caplog: pytest.LogCaptureFixture, rank: int, layout: Layout = SOLO) -> list[str]:
    """The rank's lines for one job of STEPS steps, as `common.logs` writes them, from the
    rank on (after the timestamp, level and logger)."""
    loop = RankLoop(rank, Pipe(), _write, PLATFORM, layout=layout)  # type: ignore[arg-type]
    ticket = Ticket(job_id="j1", attempt_token="t1", attempt=2, request=VideoRequest(
        prompt="p", seed=1, width=64, height=64, num_frames=9, fps=8))
    try:
        with caplog.at_level(logging.INFO, logger="runtime.rank_loop"):
            loop.apply(StepPlan(assign={layout.leader(rank): ticket}, step=True))
            for _ in range(STEPS):
                loop.step()
            loop.reported()
            deadline = time.monotonic() + 10
            while loop.leads and not loop.written(wait=0.1):
                assert time.monotonic() < deadline
    finally:
        loop.close()
    formatter = logs.TextFormatter(rank=rank)
    return [formatter.format(r).split(" ", 3)[3] for r in caplog.records
            if r.name == "runtime.rank_loop"]


def test_a_fast_job_logs_taken_its_first_and_last_steps_and_its_files(
        caplog: pytest.LogCaptureFixture) -> None:
    lines = _lines(caplog, 0)
    assert [line.split(" (")[0] for line in lines] == [
        "rank=0 job=j1 attempt=2 taken: 5 steps",
        "rank=0 job=j1 attempt=2 step 1 of 5",
        "rank=0 job=j1 attempt=2 step 5 of 5",
        "rank=0 job=j1 attempt=2 stored: videos/j1.mp4, thumbnails/j1.png"]


def test_a_slow_job_logs_every_step(caplog: pytest.LogCaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loop, "STEP_LOG_SECONDS", 0.0)  # every step is "long ago"
    steps = [line for line in _lines(caplog, 0) if " step " in line]
    assert [line.split(" (")[0] for line in steps] == [
        f"rank=0 job=j1 attempt=2 step {n} of 5" for n in range(1, STEPS + 1)]


def test_the_other_ranks_of_a_replica_log_nothing_of_its_job(
        caplog: pytest.LogCaptureFixture) -> None:
    assert _lines(caplog, 1, Layout(dp=1, sp=2)) == []
