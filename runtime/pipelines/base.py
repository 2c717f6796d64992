"""The pipeline contract: a denoising loop that the caller drives one step at a time.

Every pipeline offers

- ``state = pipe.prepare(request)``: text encoding, initial noise, the schedule. Local work only:
  no collective and no forward of a DLO-streamed transformer.
- ``pipe.step(state)``: one denoising step. It runs **exactly** ``pipe.forwards_per_step``
  forwards of every streamed transformer (``pipe.handles``); a forward the job does not need
  (no classifier-free guidance, the other expert of a two-transformer model) is replaced by
  ``handle.idle_forward()``, which takes part in the same block gathers without computing.
- ``pipe.idle_step()``: the same gathers for a rank that has no job this step.
- ``pipe.decode(state)``: float frames ``[N, H, W, 3]`` in [0, 1] (request-tiled, see
  ``runtime.tiling``).

Why: the ranks of a DLO group issue one gather per block per forward, and a gather completes only
when every rank issues it. So between two step boundaries every rank must run the same number of
forwards, whatever its job. Keeping the count fixed per step (not per job) is what lets a worker
admit a new job on one rank at a step boundary while the others carry on, check cancel flags and
report progress between steps, and drive ranks whose jobs have different step counts (a rank
that has finished calls ``idle_step`` until the longest job is done).

For the same reason the classifier-free-guidance pair is never tiled by free memory into a
varying number of forwards: free memory differs across ranks, and so would the forward counts.
Each family runs its CFG the way the reference implementation does (two batch-1 forwards for
Wan and kiln-tiny, one batch-2 forward for CogVideoX), a constant per pipeline.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.dlo import DLOHandle


@dataclass(kw_only=True, slots=True)
class VideoRequest:
    prompt: str
    negative_prompt: str = ""
    width: int = 64
    height: int = 64
    num_frames: int = 9
    num_steps: int = 4
    seed: int = 0
    guidance_scale: float = 5.0

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.width <= 0 or self.height <= 0 or self.num_frames <= 0:
            raise ValueError(f"size and frames must be positive, got {self.width}x{self.height}, "
                             f"{self.num_frames} frames")


@dataclass(kw_only=True, slots=True)
class DenoiseState:
    request: VideoRequest
    latents: torch.Tensor  # the current noisy latents, fp32
    num_steps: int  # denoising steps this job runs
    step_index: int = 0  # steps done so far
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific: embeddings, scheduler

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


class VideoPipeline(abc.ABC):
    """Base class: enforces the forwards-per-step contract of the module docstring."""

    #: Forwards of each streamed transformer per step, whatever the job.
    forwards_per_step: int = 1

    def __init__(self, handles: Sequence[DLOHandle | None]) -> None:
        self.handles = list(handles)

    @abc.abstractmethod
    def prepare(self, request: VideoRequest) -> DenoiseState: ...

    @abc.abstractmethod
    def _denoise(self, state: DenoiseState) -> Sequence[int]:
        """Advance ``state.latents`` by one step; return the forwards run per handle."""

    @abc.abstractmethod
    def decode(self, state: DenoiseState) -> torch.Tensor: ...

    def step(self, state: DenoiseState) -> None:
        if state.done:
            raise ValueError(f"the job has run all its {state.num_steps} steps")
        used = list(self._denoise(state))
        assert len(used) == len(self.handles), (used, self.handles)
        for handle, n in zip(self.handles, used, strict=True):
            assert n <= self.forwards_per_step, f"{n} forwards > {self.forwards_per_step}"
            if handle is not None:
                for _ in range(self.forwards_per_step - n):
                    handle.idle_forward()
        state.step_index += 1

    def idle_step(self) -> None:
        for handle in self.handles:
            if handle is not None:
                for _ in range(self.forwards_per_step):
                    handle.idle_forward()

    def generate(self, request: VideoRequest,
                 on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """prepare, every step, decode: a rank alone, or every rank running its job in step."""
        state = self.prepare(request)
        while not state.done:
            self.step(state)
            if on_step is not None:
                on_step(state.step_index, state.num_steps)
        return self.decode(state)

    def close(self) -> None:
        for handle in self.handles:
            if handle is not None:
                handle.close()
