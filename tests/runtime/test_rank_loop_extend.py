"""An extension's video is the clip it continues followed by the new frames: the rank writes
the request's ``Conditioning.prefix``, then what it rendered after its first frame (the clip's
last frame, which the render started from)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from runtime.pipelines.base import Conditioning, DenoiseState, VideoRequest
from runtime.rank_loop import RankLoop, StepPlan, Ticket

PLATFORM = SimpleNamespace(mem_get_info=lambda: (1, 2), device="cpu", is_accelerator=False)


class OneStepPipe:
    """One step a job; decodes to 3 frames of value 200."""

    handles: list[Any] = []
    last_step_figures: dict[str, int] = {}  # a step's counts (none here)

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        return []

    def prepare(self, request: VideoRequest) -> DenoiseState:
        return DenoiseState(request=request, latents=torch.zeros(1), num_inference_steps=1)

    def step(self, state: DenoiseState, active: Any = None) -> None:
        state.step_index += 1

    def idle_step(self, active: Any = None) -> None:
        pass

    def decode(self, state: DenoiseState) -> torch.Tensor:
        return torch.full((3, 8, 8, 3), 200 / 255)

    def close(self) -> None:
        pass


def test_an_extension_is_written_as_the_clip_then_the_new_frames() -> None:
    written: list[np.ndarray] = []

    def write(frames: np.ndarray, job_id: str, fps: int, *audio: Any) -> tuple[str, str]:
        written.append(frames)
        return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"

    clip = torch.arange(5, dtype=torch.uint8).view(5, 1, 1, 1).expand(5, 8, 8, 3).contiguous()
    request = VideoRequest(prompt="on", seed=1, width=8, height=8, num_frames=3,
                           conditioning=Conditioning(image=clip[-1], prefix=clip))
    loop = RankLoop(0, OneStepPipe(), write, PLATFORM)  # type: ignore[arg-type]
    try:
        loop.apply(StepPlan(assign={0: Ticket(job_id="j", attempt_token="t", request=request)},
                            step=True))
        assert loop.step() is not None
        loop.reported()
        ended: list[Any] = []
        while not ended:
            ended += loop.written(wait=0.1)
    finally:
        loop.close()
    [frames] = written
    assert frames.shape == (7, 8, 8, 3) and frames.dtype == np.uint8
    assert [int(f[0, 0, 0]) for f in frames] == [0, 1, 2, 3, 4, 200, 200]
