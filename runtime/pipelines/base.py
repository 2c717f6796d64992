"""The pipeline contract: a denoising loop that the caller drives one step at a time.

Every pipeline offers

- ``state = pipe.prepare(request)``: text encoding, initial noise, the schedule. Local work only:
  no collective and no forward of a DLO-streamed transformer.
- ``pipe.step(state)``: one denoising step. Every streamed transformer (``pipe.handles``)
  acquires **exactly** ``pipe.forwards_per_step`` forwards' worth of blocks: the gathers of a
  forward the job does not need (no classifier-free guidance, the other expert of a
  two-transformer model), or that a forward which raised part-way never reached, are issued
  without computing (``handle.idle_until``) before ``step`` returns or re-raises.
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
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from common.families import TINY
from common.render import RenderFields
from runtime.dlo import DLOHandle


@dataclass(kw_only=True, frozen=True, slots=True)
class VideoRequest(RenderFields):
    """One render as the pipelines take it: the render fields (``common.render``), checked. A
    field left out gets kiln-tiny's value (``common.families.TINY``), as `kiln render` does."""

    width: int = TINY.defaults.width
    height: int = TINY.defaults.height
    num_frames: int = TINY.defaults.num_frames
    fps: int = TINY.defaults.fps
    num_inference_steps: int = TINY.defaults.num_inference_steps
    guidance_scale: float = TINY.defaults.guidance_scale
    negative_prompt: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.width <= 0 or self.height <= 0 or self.num_frames <= 0:
            raise ValueError(f"size and frames must be positive, got {self.width}x{self.height}, "
                             f"{self.num_frames} frames")

    @classmethod
    def of(cls, source: Any) -> VideoRequest:
        """The request for a job: its render fields read off ``source`` by name (a job's row, or
        any `RenderFields` with its seed set); no negative prompt is the empty one."""
        values = {f.name: getattr(source, f.name) for f in fields(RenderFields)}
        values["negative_prompt"] = values["negative_prompt"] or ""
        return cls(**values)


@dataclass(kw_only=True, slots=True)
class DenoiseState:
    request: VideoRequest
    latents: torch.Tensor  # the current noisy latents, fp32
    num_inference_steps: int  # denoising steps this job runs
    step_index: int = 0  # steps done so far
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific: embeddings, scheduler

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_inference_steps


class VideoPipeline(abc.ABC):
    """Base class: enforces the forwards-per-step contract of the module docstring."""

    #: Forwards of each streamed transformer per step, whatever the job.
    forwards_per_step: int = 1

    def __init__(self, handles: Sequence[DLOHandle | None]) -> None:
        self.handles = list(handles)
        self._step_targets: list[int | None] | None = None  # inside step(): blocks to reach

    @abc.abstractmethod
    def prepare(self, request: VideoRequest) -> DenoiseState: ...

    @abc.abstractmethod
    def _denoise(self, state: DenoiseState) -> None:
        """Advance ``state.latents`` by one step, with at most ``forwards_per_step`` forwards
        of each streamed transformer."""

    @abc.abstractmethod
    def decode(self, state: DenoiseState) -> torch.Tensor: ...

    def step(self, state: DenoiseState) -> None:
        if state.done:
            raise ValueError(f"the job has run all its {state.num_inference_steps} steps")
        targets = [None if h is None else h.num_acquired + self.forwards_per_step * h.num_blocks
                   for h in self.handles]
        self._step_targets = targets
        try:
            self._denoise(state)
        finally:
            # The gathers this job did not need (no CFG, the other expert), or that a forward
            # which raised part-way never issued: every other rank is waiting for them.
            self._complete_handles_before(len(self.handles))
            self._step_targets = None
        for handle, target in zip(self.handles, targets, strict=True):
            if handle is not None and handle.num_acquired != target:
                raise AssertionError(f"{type(self).__name__} ran more than forwards_per_step="
                                     f"{self.forwards_per_step} forwards in one step")
        state.step_index += 1

    def _complete_handles_before(self, index: int) -> None:
        """Finish this step's gathers of handles ``0 .. index-1``.

        A pipeline with several streamed transformers calls this with a transformer's index
        before running it: every rank then finishes the handles in the same order, whichever
        transformer its own job needs this step. (Each handle's gathers run on their own group;
        a rank computing with handle 1 while its peer computes with handle 0 would leave both
        waiting on a gather the other will only issue later.)
        """
        assert self._step_targets is not None, "only inside step()"
        for handle, target in zip(self.handles[:index], self._step_targets, strict=False):
            if handle is not None and target is not None:
                handle.idle_until(target)

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
                on_step(state.step_index, state.num_inference_steps)
        return self.decode(state)

    def close(self) -> None:
        for handle in self.handles:
            if handle is not None:
                handle.close()
